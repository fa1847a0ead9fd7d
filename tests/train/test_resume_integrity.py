#!/usr/bin/env python3
"""What a resume can trust, through the real `parallax` binary (issue 17, items 3, 6 and 7):

- non-finite state is never committed: a run whose weights overflow fails naming the step, the
  tensor and the rank (1 rank and mpirun -np 2), the last finite checkpoint stays `latest` with
  checkpoint.keep_last=1, `inspect` says OK, and a resume continues from it;
- optim.lr=inf / nan is a config error naming the key;
- each metrics row exactly once: runs killed with SIGKILL at random moments (between checkpoints,
  right after a commit; sync and async saves) and resumed with train.resume=auto until done log
  every step 1..N exactly once, with the losses of the uninterrupted run (CPU fp32 resume is
  bitwise);
- a resume with a changed config warns once, listing each changed key (old -> new), keeps the
  replaced config.yaml in config_history/, and a structural change names the config key;
- an edited metadata.json (its step) is refused by inspect and by resume, naming the file.

Usage: test_resume_integrity.py <parallax binary> <mpirun>
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, RunDirTest)


def rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def checkpoints(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if os.path.isdir(d) else []


class ResumeIntegrityTest(tt.RunDirTest):
    COMMON = ["model.size=tiny", "train.log_every=1", "schedule.warmup_steps=2", "train.device=cpu"]

    # A run that saved steps 2, 4 and 6, the start of the tests of a lost or broken `latest`.
    SAVED = ("train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=4")

    @classmethod
    def setUpClass(cls):
        cls.shared = tempfile.TemporaryDirectory()
        cls.saved_runs = {}

    @classmethod
    def tearDownClass(cls):
        cls.shared.cleanup()

    def saved_run(self, name, ranks, config):
        """A copy, named `name` in this test's folder, of a run trained with `config` on `ranks`
        ranks. Tests that start from the same run (6 steps saving 2, 4, 6: a lost or broken
        `latest` on 1 and 2 ranks and a checksum mismatch on 2; 2 steps saving each with keep_last
        1: the non-finite save on 1 rank and the `latest` pointer) share one training per class.
        The copy is resumed under its own folder and name, which the resume lists among the
        changed keys of its config warning."""
        key = (ranks, tuple(config))
        if key not in self.saved_runs:
            saved = f"saved{len(self.saved_runs)}"
            tt.run(["train", "--config", tt.MLP, f"experiment.output_dir={self.shared.name}",
                    f"experiment.name={saved}", *self.COMMON, *config], ranks)
            self.saved_runs[key] = os.path.join(self.shared.name, saved)
        run_dir = os.path.join(self.d, name)
        shutil.copytree(self.saved_runs[key], run_dir)
        return run_dir

    # ---- item 3: no NaN checkpoint --------------------------------------------------------------

    def check_nonfinite_never_committed(self, ranks):
        name = f"diverge{ranks}"
        keep = ("checkpoint.every=1", "checkpoint.keep_last=1")
        run_dir = self.saved_run(name, ranks, ("train.steps=2", *keep))
        # lr 1e39 is a finite double, but one AdamW step moves every weight by ~1e39: past float32's
        # range (3.4e38). Step 3's loss is still finite (computed before the update), so the first
        # thing to meet the infinite weights is the save of step 3.
        p = tt.run(self.common(name, "train.steps=6", "train.resume=auto", "optim.lr=1e39", *keep), ranks,
                   check=False, timeout=300)
        self.assertNotEqual(p.returncode, 0, p.stderr[-3000:])
        self.assertRegex(p.stderr, r"parallax: error: .*save of step 3 refused: tensor '(model|optim)/[^']+' holds "
                                   r"\d+ NaN and \d+ infinite value\(s\)")
        self.assertRegex(p.stderr, r"rank \d: save of step 3 refused")
        # The last finite checkpoint is latest and was not pruned (keep_last=1).
        self.assertEqual(checkpoints(run_dir), ["latest", "step_00000002"])
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), "step_00000002")
        ins = tt.run(["inspect", run_dir])
        self.assertIn("step 2", ins.stdout)
        self.assertRegex(ins.stdout, r"verified: .*: OK")
        # A resume with a sane lr continues from it; step 3's row of the failed run is logged once.
        tt.run(self.common(name, "train.steps=4", "train.resume=auto", *keep), ranks)
        self.assertEqual([r["step"] for r in tt.metrics(run_dir)], [1, 2, 3, 4])

    def test_nonfinite_state_is_never_committed_one_rank(self):
        self.check_nonfinite_never_committed(1)

    def test_nonfinite_state_is_never_committed_two_ranks(self):
        self.check_nonfinite_never_committed(2)

    def test_infinite_or_nan_learning_rate_is_a_config_error(self):
        for value in ("inf", ".inf", "nan"):
            p = tt.run(self.common("lr", "train.steps=1", f"optim.lr={value}"), check=False)
            self.assertNotEqual(p.returncode, 0, value)
            self.assertIn("parallax: error:", p.stderr)
            self.assertIn("key 'optim.lr'", p.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.d, "lr", "checkpoints")))

    # ---- item 6: each metrics row exactly once across kills --------------------------------------

    STEPS = 60

    def kill_and_resume(self, name, extra, rng, kills):
        """Runs `name` with train.resume=auto, SIGKILLed `kills` times at random moments, until it
        completes. Returns (kills done, resumes that dropped rows logged after the checkpoint)."""
        run_dir = os.path.join(self.d, name)
        cmd = [tt.PARALLAX, *self.common(name, f"train.steps={self.STEPS}", "checkpoint.every=3",
                                         "train.resume=auto", *extra)]
        done_kills = dropped = 0
        for attempt in range(kills + 20):
            stale = max([r["step"] for r in rows(run_dir)], default=0)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            lines, committed = [], threading.Event()
            # "commit": kill right after a checkpoint commits (its row must not be lost);
            # "rows": kill once this run logged a random step past every stale row (between checkpoints).
            trigger = rng.choice(["commit", "rows"]) if done_kills < kills else None
            # A few steps past the stale rows, so that the kills spread over the run.
            target = min(stale + rng.randint(1, 4), self.STEPS)

            def pump():
                for line in proc.stderr:
                    lines.append(line)
                    m = re.search(r"checkpoint step (\d+) committed|saved step (\d+) .*in the background", line)
                    if m and trigger == "commit" and int(m.group(1) or m.group(2)) > 0:
                        committed.set()

            t = threading.Thread(target=pump, daemon=True)
            t.start()
            killed = False
            deadline = time.time() + 120
            while trigger and proc.poll() is None and time.time() < deadline:
                if trigger == "commit" and committed.wait(0.001):
                    killed = True
                elif trigger == "rows" and target > stale and any(r["step"] >= target for r in rows(run_dir)[-3:]):
                    time.sleep(rng.uniform(0, 0.004))
                    killed = True
                else:
                    time.sleep(0.0005)
                if killed:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            rc = proc.wait(timeout=300)
            t.join(timeout=10)
            proc.stderr.close()
            log = "".join(lines)
            if re.search(r"dropped [1-9]\d* later", log):
                dropped += 1
            if killed and rc == -signal.SIGKILL:
                done_kills += 1
                continue
            self.assertEqual(rc, 0, f"{name}: attempt {attempt} failed:\n{log[-3000:]}")
            return done_kills, dropped
        self.fail(f"{name}: did not complete")

    def test_kills_and_resumes_log_each_step_once_with_the_uninterrupted_losses(self):
        seed = random.SystemRandom().randrange(1 << 30)
        rng = random.Random(seed)
        ref_dir = os.path.join(self.d, "ref")
        tt.run(self.common("ref", f"train.steps={self.STEPS}", "checkpoint.every=3"))
        ref = {r["step"]: r["loss"] for r in tt.metrics(ref_dir)}
        self.assertEqual(sorted(ref), list(range(1, self.STEPS + 1)))
        total_dropped = 0
        for mode, extra in (("sync", []), ("async", ["checkpoint.async=true"])):
            kills, dropped = self.kill_and_resume(mode, extra, rng, kills=6)
            total_dropped += dropped
            print(f"{mode}: {kills} kills, {dropped} resume(s) dropped rows logged after their checkpoint "
                  f"(seed {seed})")
            run_dir = os.path.join(self.d, mode)
            train = tt.metrics(run_dir)
            steps = [r["step"] for r in train]
            msg = f"{mode} (seed {seed}, {kills} kills): steps {steps}"
            self.assertGreaterEqual(kills, 4, msg)
            self.assertEqual(steps, list(range(1, self.STEPS + 1)), msg)
            for r in train:
                self.assertEqual(r["loss"], ref[r["step"]], f"{msg}: loss at step {r['step']}")
            self.assertEqual([r["step"] for r in tt.metrics(run_dir, "summary")], [self.STEPS], msg)
        # The kills did land after rows that the checkpoint did not cover (the duplicate case).
        self.assertGreaterEqual(total_dropped, 1, f"seed {seed}: no resume had rows to drop")

    # ---- item 7: resume with a changed config ---------------------------------------------------

    def test_changed_config_warns_once_keeps_history_and_names_structural_keys(self):
        run_dir = os.path.join(self.d, "cfg")
        tt.run(self.common("cfg", "train.steps=2", "checkpoint.every=2"))
        p = tt.run(self.common("cfg", "train.steps=4", "train.resume=auto", "optim.lr=0.001", "data.batch_size=32",
                               "precision.mode=bf16", "optim.betas=[0.8,0.99]", "optim.weight_decay=0.05",
                               "experiment.seed=7"))
        warns = [l for l in p.stderr.splitlines() if "WARN" in l and "differs from the checkpoint's" in l]
        self.assertEqual(len(warns), 1, p.stderr[-3000:])
        for change in ("optim.lr: 0.003 -> 0.001", "data.batch_size: 64 -> 32", "precision.mode: fp32 -> bf16",
                       "optim.betas: [0.9, 0.999] -> [0.8, 0.99]", "optim.weight_decay: 0.01 -> 0.05",
                       "experiment.seed: 42 -> 7", "train.steps: 2 -> 4"):
            self.assertIn(change, warns[0])
        self.assertNotIn("train.resume", warns[0])
        # config.yaml is the current config; the replaced one is kept with the step it was replaced at.
        self.assertEqual(os.listdir(os.path.join(run_dir, "config_history")), ["step_00000002.yaml"])
        with open(os.path.join(run_dir, "config_history", "step_00000002.yaml")) as f:
            self.assertRegex(f.read(), r"lr: 0\.003")
        with open(os.path.join(run_dir, "config.yaml")) as f:
            self.assertRegex(f.read(), r"lr: 0\.001")
        # Same config again: no warning about the step-4 checkpoint's config, no new history entry.
        p = tt.run(self.common("cfg", "train.steps=4", "train.resume=auto", "optim.lr=0.001", "data.batch_size=32",
                               "precision.mode=bf16", "optim.betas=[0.8,0.99]", "optim.weight_decay=0.05",
                               "experiment.seed=7"))
        self.assertNotIn("differs from the checkpoint's", p.stderr)
        self.assertEqual(os.listdir(os.path.join(run_dir, "config_history")), ["step_00000002.yaml"])
        # A structural change: the error names the config key, not only the tensors; nothing changes on disk.
        p = tt.run(self.common("cfg", "train.steps=6", "train.resume=auto", "model.size=small"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"parallax: error: .*shape mismatch.*config keys changed since the checkpoint was "
                                   r"saved: model\.size: tiny -> small")
        self.assertEqual(os.listdir(os.path.join(run_dir, "config_history")), ["step_00000002.yaml"])
        with open(os.path.join(run_dir, "config.yaml")) as f:
            self.assertRegex(f.read(), r"size: tiny")

    def test_edited_metadata_is_refused_by_inspect_and_resume(self):
        run_dir = os.path.join(self.d, "meta")
        tt.run(self.common("meta", "train.steps=3"))
        path = os.path.join(run_dir, "checkpoints", "step_00000003", "metadata.json")
        with open(path) as f:
            text = f.read()
        self.assertIn('"step": 3,', text)
        with open(path, "w") as f:
            f.write(text.replace('"step": 3,', '"step": 999,'))
        for args in (["inspect", run_dir], self.common("meta", "train.steps=1000", "train.resume=auto")):
            p = tt.run(args, check=False)
            self.assertNotEqual(p.returncode, 0, args)
            self.assertRegex(p.stderr, r"parallax: error: .*'.*step_00000003/metadata\.json': checksum mismatch")
        self.assertEqual([r["step"] for r in tt.metrics(run_dir)], [1, 2, 3])

    # ---- issue 35, items 4 and 5: a lost or broken `latest` --------------------------------------

    def train_rows(self, run_dir, upto):
        """The raw lines of metrics.jsonl's train rows of steps <= upto (timings make them unique to
        the run that logged them: a retrained step never reproduces its line)."""
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [line for line in f if json.loads(line).get("kind") == "train"
                    and json.loads(line)["step"] <= upto]

    def check_resumes_from(self, name, ranks, step, warning, total=8):
        run_dir = os.path.join(self.d, name)
        kept = self.train_rows(run_dir, step)
        self.assertEqual(len(kept), step)
        p = tt.run(self.common(name, f"train.steps={total}", "train.resume=auto", "checkpoint.every=2",
                               "checkpoint.keep_last=4"), ranks)
        warns = [l for l in p.stderr.splitlines() if "WARN" in l and "train.resume=auto" in l]
        self.assertEqual(len(warns), 1, p.stderr[-3000:])  # rank 0's, once
        self.assertRegex(warns[0], warning)
        self.assertIn(f"resuming from '{os.path.join(run_dir, 'checkpoints', f'step_{step:08d}')}' (step {step})",
                      warns[0])
        # The rows of the steps it did not retrain are the first run's, untouched; the others once.
        self.assertEqual(self.train_rows(run_dir, step), kept)
        self.assertEqual([r["step"] for r in tt.metrics(run_dir)], list(range(1, total + 1)))
        return p

    def test_lost_latest_resumes_from_the_newest_step_that_verifies(self):
        for ranks in (1, 2):
            name = f"lost{ranks}"
            run_dir = self.saved_run(name, ranks, self.SAVED)
            self.assertEqual(checkpoints(run_dir), ["latest", "step_00000002", "step_00000004", "step_00000006"])
            os.remove(os.path.join(run_dir, "checkpoints", "latest"))
            self.check_resumes_from(name, ranks, 6, r"checkpoints/latest' is missing")
            with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
                self.assertEqual(f.read().strip(), "step_00000008")

    def test_latest_naming_a_broken_step_falls_back_to_an_older_one_and_never_starts_over(self):
        name = "broken"
        run_dir = self.saved_run(name, 1, self.SAVED)
        ckpts = os.path.join(run_dir, "checkpoints")
        # Step 6 lost a rank file (an interrupted copy, a full disk): the newest older step is used.
        os.remove(os.path.join(ckpts, "step_00000006", "rank_00000.h5"))
        self.check_resumes_from(name, 1, 4, r"latest' names step_00000006, which cannot be resumed from: "
                                            r".*rank_00000\.h5' \(rank 0\) is missing")
        # Nothing verifies any more: an error naming each step's problem; the run directory as it was.
        for step in (2, 4, 6, 8):
            os.remove(os.path.join(ckpts, f"step_{step:08d}", "metadata.json"))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            before = f.read()
        p = tt.run(self.common(name, "train.steps=10", "train.resume=auto"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"parallax: error: train\.resume=auto: .*latest' names step_00000008, which "
                                   r"cannot be resumed from: .*no older checkpoint in .* verifies: step 6: .*; "
                                   r"step 4: .*; step 2: .*Not starting over")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            self.assertEqual(f.read(), before)

    def test_a_checksum_mismatch_in_latest_falls_back_and_is_not_blamed_on_the_config(self):
        """A byte flipped inside a shard's data (the file keeps its size, so only the checksum can
        tell) made train.resume=auto refuse, blaming "config keys changed since the checkpoint was
        saved". On 2 ranks (rank 1 verifies rank_00001.h5) it falls back like a truncated shard; an
        explicit train.resume names the corruption alone."""
        name = "crc"
        ckpts = os.path.join(self.d, name, "checkpoints")

        def corrupt(step):
            """Flips a byte of a model tensor's data in rank_00001.h5 of `step`; returns the tensor."""
            step_dir = os.path.join(ckpts, f"step_{step:08d}")
            with open(os.path.join(step_dir, "metadata.json")) as f:
                tensors = json.load(f)["tensors"]
            tensor = next(n for n, t in sorted(tensors.items()) if n.startswith("model/") and t["shape"]
                          and any(s["file"] == "rank_00001.h5" for s in t["shards"]))
            tt.flip_byte(os.path.join(step_dir, "rank_00001.h5"), tensor)
            return step_dir, tensor

        self.saved_run(name, 2, self.SAVED)
        _, tensor = corrupt(6)
        self.check_resumes_from(name, 2, 4, r"latest' names step_00000006, which cannot be resumed from: .*"
                                            r"checksum mismatch in shard file 'rank_00001\.h5' for tensor '"
                                            + re.escape(tensor) + "'")
        # The resumed run saved steps 6 and 8 anew. An explicit path to a corrupt one, with a changed
        # config (train.steps): the error names the shard and the tensor, not the config.
        step8, tensor = corrupt(8)
        p = tt.run(self.common(name, "train.steps=9", f"train.resume={step8}"), check=False)
        self.assertNotEqual(p.returncode, 0)
        errors = [l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]
        self.assertEqual(len(errors), 1, p.stderr[-3000:])
        self.assertIn(f"checksum mismatch in shard file 'rank_00001.h5' for tensor '{tensor}'", errors[0])
        self.assertIn("train.steps: 8 -> 9", p.stderr)  # the config did change...
        self.assertNotIn("config keys changed", errors[0])  # ...but it is not blamed

    def test_the_latest_pointer_is_accepted_by_inspect_and_export(self):
        # The non-finite test's first run (keep_last=1 keeps step 2 alone: latest's step either way).
        run_dir = self.saved_run("ptr", 1, ("train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=1"))
        latest = os.path.join(run_dir, "checkpoints", "latest")
        ins = tt.run(["inspect", latest])
        self.assertIn("step 2", ins.stdout)
        self.assertRegex(ins.stdout, r"verified: .*: OK")
        out = os.path.join(self.d, "ptr_weights.h5")
        exp = tt.run(["export", "--checkpoint", latest, "--out", out, "--format", "weights"])
        self.assertIn(os.path.join(run_dir, "checkpoints", "step_00000002"), exp.stdout)
        self.assertTrue(os.path.exists(out))
        # A resume from the pointer, as train.resume=<path>.
        tt.run(self.common("ptr", "train.steps=3", f"train.resume={latest}"))
        self.assertEqual([r["step"] for r in tt.metrics(run_dir)], [1, 2, 3])


if __name__ == "__main__":
    tt.PARALLAX = os.path.abspath(sys.argv.pop(1))
    tt.MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
