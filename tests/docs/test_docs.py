#!/usr/bin/env python3
"""The documentation runs as written: every shell block of README.md and docs/*.md is run, or says
why not.

A block is a fenced block tagged bash, sh, shell or console, a python block, or an untagged block
whose first command line starts with a command (parallax, mpirun, python3, build/bin/..., see
COMMAND). Each one is preceded (blank lines allowed) by a marker that decides what happens to it:

    <!-- doc-test: skip (needs a GPU) -->             never run; the reason is required
    <!-- doc-test: run -->                            run verbatim, expect exit code 0
    <!-- doc-test: run; sub "train.steps=600" "train.steps=6"; exit 3; env K=V; timeout 60;
         setup "cmd"; prelude "code"; check all -->

Options of `run` (separated by `;`, arguments quoted as in the shell):
- `sub OLD NEW`: replace OLD (which must occur) by NEW before running; `{tiny}` in NEW stands for
  TINY_DATAGEN, the small synthetic dataset's datagen options;
- `exit N`: the expected exit code (default 0);
- `env K=V`: an environment variable for the block;
- `setup CMD`: a shell command run first (must succeed), e.g. to make an input the block reads
  or to do what a skipped block before it does (`{tiny}` as in `sub`);
- `prelude CODE`: python blocks: code run before the block (variables the snippet assumes);
- `timeout S`: seconds (default 120);
- `check first|all|none`: for blocks of `$ command` lines followed by their output, how much of
  the output is compared: the first line (default), every shown line in order (a line `...` skips
  any number of lines, a line ending in `...` matches by its prefix), or nothing.

A block without a marker fails the test, so a new example needs a decision.

Blocks run in one scratch folder, in order (README.md, then docs/*.md by name), as a user
following README.md and then the docs would run them in one checkout: so each page's training
examples must use their own `experiment.name` (or `train.resume=auto` to continue a run), and may
use what README.md's tour made (datasets/synth, runs/bev_tiny). The folder holds copies of
configs/ with few steps (SCRATCH_CONFIG), links to tools/ and bench/, `build/bin/*` linked to the
binaries under test, and a bin/ first on PATH with `parallax`, `mpirun` and `python3`.

Every verb's `--help` is checked as well: the options its examples use and the config keys it
names must exist, and its `key=value` examples must load.

Usage: test_docs.py <parallax binary> <mpirun> [--keep] [--only docs/FILE.md ...]
(--keep leaves the scratch folder; --only runs README.md and the pages named.)
"""
import glob
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import yaml

PARALLAX = MPIRUN = None
KEEP = False
ONLY = None
SRC = os.path.abspath(
    os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))

SHELL_TAGS = {"bash", "sh", "shell", "console"}
PYTHON_TAGS = {"python", "py", "python3"}
# An untagged block is a shell block when its first command line starts with one of these.
COMMAND = re.compile(r"^(\$ )?(parallax|mpirun|srun|torchrun|python3?|trtexec|polygraphy|ctest|"
                     r"cmake|cd|tensorboard|sbatch|(build[\w-]*/bin|scripts|bench|tools)/\S+)(\s|$)")
# `model.onnx` and `data.md` in a help text are files, not config keys.
FILE_SUFFIXES = {"md", "onnx", "yaml", "json", "h5", "py", "sh", "txt", "data", "png", "jsonl",
                 "safetensors", "pt", "pth"}
MARKER = re.compile(r"<!--\s*doc-test:(.*?)-->", re.S)
# The small dataset every `datagen` of the docs makes instead of 1000 scenes (sub "{tiny}").
TINY_DATAGEN = ("--scenes 8 --val-scenes 4 --cameras 2 --height 64 --width 112 "
                "--samples-per-pixel 1")
# The scratch copies of the configs the docs train on the CPU: few steps, small eval and export.
SCRATCH_CONFIG = {
    "bev_tiny.yaml": {"train": {"steps": 2, "log_every": 1}, "schedule": {"warmup_steps": 1},
                      "data": {"batch_size": 2}, "export": {"parity_frames": 2},
                      "qat": {"calib_batches": 1}},
    "mlp_demo.yaml": {"train": {"steps": 2, "log_every": 1}, "schedule": {"warmup_steps": 1},
                      "data": {"batch_size": 8}},
}
DEFAULT_TIMEOUT = 120


class Block:
    def __init__(self, path, line, tag, lines, marker):
        self.path, self.line, self.tag, self.lines, self.marker = path, line, tag, lines, marker

    @property
    def where(self):
        return f"{os.path.relpath(self.path, SRC)}:{self.line}"

    @property
    def kind(self):
        if self.tag in SHELL_TAGS:
            return "shell"
        if self.tag in PYTHON_TAGS:
            return "python"
        if self.tag:
            return "other"  # yaml, json, cpp: not commands
        first = next((l.strip() for l in self.lines if l.strip() and not l.strip().startswith("#")),
                     "")
        return "shell" if COMMAND.match(first) else "other"


def doc_files():
    return [os.path.join(SRC, "README.md")] + sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))


def marker_before(lines, i):
    """The doc-test marker that ends on the last non-blank line before line i, or None."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or not lines[j].rstrip().endswith("-->"):
        return None
    k = j
    while k >= 0 and "<!--" not in lines[k]:
        k -= 1
    m = MARKER.search("\n".join(lines[k:j + 1]))
    return m.group(1).strip() if m else None


def extract_blocks(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, j = m.group(1), i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        blocks.append(Block(path, i + 1, m.group(2).lower(), lines[i + 1:j], marker_before(lines, i)))
        i = j + 1
    return blocks


def parse_marker(text):
    """('skip', reason) or ('run', options); raises ValueError for a malformed marker."""
    if text.startswith("skip"):
        m = re.fullmatch(r"skip\s*\((.+)\)", text, re.S)
        if not m or not m.group(1).strip():
            raise ValueError(f"'{text}': a skip needs a reason in parentheses")
        return "skip", m.group(1).strip()
    lex = shlex.shlex(text, posix=True, punctuation_chars=";")
    lex.whitespace_split = True
    words, parts = list(lex), [[]]
    for w in words:
        if w == ";":
            parts.append([])
        else:
            parts[-1].append(w)
    parts = [p for p in parts if p]
    if not parts or parts[0] != ["run"]:
        raise ValueError(f"'{text}': expected 'skip (reason)' or 'run[; option ...]'")
    opts = {"sub": [], "env": {}, "exit": 0, "setup": [], "prelude": "", "timeout": DEFAULT_TIMEOUT,
            "check": "first"}
    arity = {"sub": 2, "env": 1, "exit": 1, "setup": 1, "prelude": 1, "timeout": 1, "check": 1}
    for p in parts[1:]:
        name, args = p[0], p[1:]
        if name not in arity or len(args) != arity[name]:
            raise ValueError(f"'{text}': bad option {p} (options: {sorted(arity)})")
        if name == "sub":
            opts["sub"].append((args[0], args[1].replace("{tiny}", TINY_DATAGEN)))
        elif name == "env":
            k, _, v = args[0].partition("=")
            opts["env"][k] = v
        elif name in ("exit", "timeout"):
            opts[name] = int(args[0])
        elif name == "setup":
            opts["setup"].append(args[0].replace("{tiny}", TINY_DATAGEN))
        elif name == "check":
            if args[0] not in ("first", "all", "none"):
                raise ValueError(f"'{text}': check first|all|none, got {args[0]}")
            opts["check"] = args[0]
        else:
            opts[name] = args[0]
    return "run", opts


def substituted(block, opts):
    text = "\n".join(block.lines)
    for old, new in opts["sub"]:
        if old not in text:
            raise AssertionError(f"{block.where}: sub '{old}' does not occur in the block")
        text = text.replace(old, new)
    return text


def prompt_commands(text):
    """[(command, shown output lines)] for a block of `$ command` lines, else None."""
    lines = text.split("\n")
    if not lines or not lines[0].startswith("$ "):
        return None
    out, i = [], 0
    while i < len(lines):
        cmd = lines[i][2:]
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd[:-1] + " " + lines[i].strip()
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        out.append((cmd, [s for s in shown if s.strip()]))
    return out


def output_problem(shown, got, mode):
    """None when `got` (the command's output) shows what the doc shows, else what differs."""
    got_lines = [g.rstrip() for g in got.split("\n") if g.strip()]
    if mode == "none" or not shown:
        return None
    if mode == "first":
        want = shown[0].rstrip()
        have = got_lines[0] if got_lines else ""
        if want.endswith("..."):
            return None if have.startswith(want[:-3].rstrip()) else f"first line\n  doc: {want}\n  got: {have}"
        return None if have == want else f"first line\n  doc: {want}\n  got: {have}"
    k = 0  # mode "all": every shown line, in order; "..." skips lines
    for want in (s.rstrip() for s in shown):
        if want.strip() == "...":
            continue
        prefix = want.endswith("...")
        w = want[:-3].rstrip() if prefix else want
        while k < len(got_lines) and not (got_lines[k].startswith(w) if prefix else got_lines[k] == w):
            k += 1
        if k == len(got_lines):
            return f"the doc's line\n  {want}\nis not in the output (in order):\n  " + "\n  ".join(got_lines)
        k += 1
    return None


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def make_scratch(root):
    """configs/ (SCRATCH_CONFIG applied), tools/ and bench/ links, build/bin/*, bin/ for PATH."""
    shutil.copytree(os.path.join(SRC, "configs"), os.path.join(root, "configs"))
    for name, changes in SCRATCH_CONFIG.items():
        path = os.path.join(root, "configs", name)
        with open(path) as f:
            cfg = yaml.safe_load(f)
        for section, keys in changes.items():
            cfg.setdefault(section, {}).update(keys)
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
    for d in ("tools", "bench"):
        os.symlink(os.path.join(SRC, d), os.path.join(root, d))
    bindir = os.path.dirname(os.path.abspath(PARALLAX))
    os.makedirs(os.path.join(root, "build", "bin"))
    for f in os.listdir(bindir):
        os.symlink(os.path.join(bindir, f), os.path.join(root, "build", "bin", f))
    os.makedirs(os.path.join(root, "bin"))
    for name, target in (("parallax", PARALLAX), ("mpirun", MPIRUN), ("python3", sys.executable),
                         ("python", sys.executable)):
        os.symlink(os.path.abspath(target), os.path.join(root, "bin", name))


class DocsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.blocks = [b for f in doc_files() for b in extract_blocks(f)]
        cls.tmp = tempfile.mkdtemp(prefix="parallax_docs_")
        make_scratch(cls.tmp)
        cls.env = dict(os.environ)
        cls.env["PATH"] = os.path.join(cls.tmp, "bin") + os.pathsep + cls.env.get("PATH", "")
        cls.env["PARALLAX_SOURCE_DIR"] = SRC

    @classmethod
    def tearDownClass(cls):
        if KEEP:
            print(f"scratch folder kept: {cls.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_block_has_a_decision(self):
        """A shell or python block without a marker, a malformed marker or a skip without a
        reason fails here, naming the file and line."""
        problems = []
        for b in self.blocks:
            if b.kind == "other":
                continue
            if b.marker is None:
                problems.append(f"{b.where}: {b.kind} block without a '<!-- doc-test: run ... -->' "
                                f"or '<!-- doc-test: skip (reason) -->' marker before it")
                continue
            try:
                parse_marker(b.marker)
            except ValueError as e:
                problems.append(f"{b.where}: {e}")
        self.assertFalse(problems, "\n" + "\n".join(problems))

    def test_marker_grammar_and_output_matching(self):
        """The harness itself: markers parse or are refused, output is matched as documented."""
        self.assertEqual(parse_marker("skip (needs a GPU)"), ("skip", "needs a GPU"))
        for bad in ("skip", "skip ()", "run; exit", "run; frobnicate 1", "walk", "run; check most"):
            with self.assertRaises(ValueError, msg=bad):
                parse_marker(bad)
        _, o = parse_marker('run; sub "a b" "c {tiny}"; exit 3; env K=V; check all')
        self.assertEqual((o["sub"], o["exit"], o["env"], o["check"]),
                         ([("a b", "c " + TINY_DATAGEN)], 3, {"K": "V"}, "all"))
        b = Block("x.md", 1, "bash", ["echo hi"], None)
        with self.assertRaises(AssertionError):
            substituted(b, {"sub": [("absent", "x")]})
        self.assertEqual(prompt_commands("$ a \\\n  b\nout 1\nout 2\n$ c"),
                         [("a  b", ["out 1", "out 2"]), ("c", [])])
        got = "head\nrow 1\nrow 2\nrow 3\ntail: long text\n"
        self.assertIsNone(output_problem(["head", "...", "row 3", "tail: long ..."], got, "all"))
        self.assertIsNotNone(output_problem(["head", "row 3", "row 2"], got, "all"))
        self.assertIsNone(output_problem(["head", "anything"], got, "first"))
        self.assertIsNotNone(output_problem(["heap"], got, "first"))

    def test_help_texts_name_real_options_and_keys(self):
        """Every verb's --help: the options its examples use are its own, the config keys it
        names exist (`parallax train --help-config`), and its examples' `key=value` overrides
        load (`--print-config` on configs/bev_tiny.yaml)."""
        top = self.parallax("--help").stdout
        verbs = re.findall(r"^  (\w+)\s", top.split("verbs:", 1)[-1], re.M)
        self.assertIn("train", verbs)
        listing = self.parallax("train", "--help-config").stdout
        keys = {l.split()[0] for l in listing.splitlines() if l.strip()}
        sections = {k.split(".")[0] for k in keys}
        problems = []
        for verb in verbs:
            p = self.parallax(verb, "--help")
            if p.returncode != 0:
                problems.append(f"parallax {verb} --help: exit {p.returncode}")
                continue
            options = set(re.findall(r"^\s+(--[\w-]+)", p.stdout, re.M))
            overrides = []
            for line in p.stdout.splitlines():
                for tok in re.findall(r"[~\w.\[\]'=+-]+", line):
                    tok = tok.strip("'.")
                    m = re.fullmatch(r"~?([a-z_]+(?:\.[a-z_0-9]+|\[\d+\])+)(=\S+)?", tok)
                    if (not m or m.group(1).split(".")[0] not in sections
                            or m.group(1).rsplit(".", 1)[-1] in FILE_SUFFIXES):
                        continue
                    path = re.sub(r"\[\d+\]$|\.\d+$", "", m.group(1))
                    if path not in keys and not any(k.startswith(path + ".") for k in keys):
                        problems.append(f"parallax {verb} --help names '{tok}': no such config key")
                    elif m.group(2) or tok.startswith("~"):
                        overrides.append(tok)
                example = line.split("#", 1)[0].split(" -- ", 1)[0]  # launch: the worker's own
                if re.match(r"^\s+(mpirun .*)?parallax " + verb + r"\b", example):
                    for opt in re.findall(r"(?<!\S)(--[\w-]+)", example):
                        if opt not in options and opt != "--help":
                            problems.append(f"parallax {verb} --help: example uses {opt}, "
                                            f"which is not an option of {verb}")
            for o in overrides:
                q = self.parallax("train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"),
                                  o, "--print-config")
                if q.returncode != 0:
                    problems.append(f"parallax {verb} --help: override '{o}' fails: "
                                    f"{q.stderr.strip()}")
        self.assertFalse(problems, "\n" + "\n".join(problems))

    def parallax(self, *args):
        return subprocess.run([PARALLAX, *args], capture_output=True, text=True, timeout=60)

    def test_runnable_blocks_run(self):
        counts = {"run": 0, "skip": 0}
        for b in self.blocks:
            if b.kind == "other" or b.marker is None:
                continue
            if ONLY and os.path.relpath(b.path, SRC) not in ONLY + ["README.md"]:
                continue  # --only: README.md's tour, which the pages build on, runs too
            try:
                decision, opts = parse_marker(b.marker)
            except ValueError:
                continue  # reported by test_every_block_has_a_decision
            counts[decision] += 1
            if decision == "skip":
                continue
            with self.subTest(block=b.where):
                start, cpu = time.monotonic(), children_cpu_s()
                self.run_block(b, opts)
                print(f"[docs] {b.where}: ok in {time.monotonic() - start:.1f} s "
                      f"({children_cpu_s() - cpu:.1f} s CPU)", file=sys.stderr)
        print(f"[docs] {counts['run']} blocks run, {counts['skip']} skipped", file=sys.stderr)

    def sh(self, command, block, opts):
        env = dict(self.env, **opts["env"])
        try:
            return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=self.tmp,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=opts["timeout"])
        except subprocess.TimeoutExpired:
            self.fail(f"{block.where}: did not finish within {opts['timeout']} s:\n{command}")

    def run_block(self, b, opts):
        text = substituted(b, opts)
        for cmd in opts["setup"]:
            p = self.sh(cmd, b, dict(opts, env=opts["env"]))
            self.assertEqual(p.returncode, 0, f"{b.where}: setup '{cmd}' failed:\n{p.stdout[-3000:]}")
        if b.kind == "python":
            script = os.path.join(self.tmp, "_doc_block.py")
            with open(script, "w") as f:
                f.write(opts["prelude"] + "\n" + text + "\n")
            runs = [(f"python3 {shlex.quote(script)}", None)]
        else:
            runs = prompt_commands(text) or [(text, None)]
        for cmd, shown in runs:
            p = self.sh(cmd, b, opts)
            self.assertEqual(p.returncode, opts["exit"],
                             f"{b.where}: exit code {p.returncode}, expected {opts['exit']}, "
                             f"running\n{cmd}\n--- output (last 60 lines):\n"
                             + "\n".join(p.stdout.split("\n")[-60:]))
            if shown is not None:
                problem = output_problem(shown, p.stdout, opts["check"])
                self.assertIsNone(problem, f"{b.where}: `{cmd}`: {problem}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--keep" in args:
        KEEP = True
        args.remove("--keep")
    while "--only" in args:
        i = args.index("--only")
        ONLY = (ONLY or []) + [args[i + 1]]
        del args[i:i + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    PARALLAX, MPIRUN = os.path.abspath(args[0]), args[1]
    unittest.main(argv=[sys.argv[0]], verbosity=2)
