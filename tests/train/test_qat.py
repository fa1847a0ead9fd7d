#!/usr/bin/env python3
"""QAT and PTQ through the real `parallax` binary (issue 21, the qat part; train/qat.h), bev_tiny
(conv backbone) on CPU, starting from a 2-step fp32 run:

- ptq (bf16 autocast) on a generated dataset: calibrates (a "prepare" row with the calibration
  statistics), writes the sensitivity report (one unit quantized at a time), evaluates and saves at
  step 0 with no optimizer step: the saved weights are the fp32 ones, bitwise, beside an amax
  buffer per quantizer; `parallax eval` evaluates the checkpoint fake-quantized;
- qat on 2 ranks (DDP, activation checkpointing): both ranks end the calibration with the same
  amax (the fingerprint each rank logs), training runs, and a resume from the step-2 checkpoint
  repeats steps 3-4 bitwise without calibrating again; under ZeRO-3 the calibration gives the same
  amax;
- bad inputs (unknown calibrator, a skip glob matching nothing, no train.load_from, tp > 1) are
  each one `parallax: error:` line naming the key.

Usage: test_qat.py <parallax binary> <mpirun>
"""
import json
import os
import re
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402
from test_zero_checkpoint import metadata  # noqa: E402


class QatTest(tt.RunDirTest):
    COMMON = ["train.log_every=1", "train.device=cpu", "data.batch_size=2", "schedule.name=constant",
              "schedule.warmup_steps=1"]

    def bev(self, name, *extra, ranks=1, check=True):
        args = ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                *self.COMMON, *extra]
        return tt.run(args, ranks, check=check)

    def base(self, *extra):
        self.bev("base", "train.steps=2", *extra)
        return f"train.load_from={os.path.join(self.d, 'base')}"

    def test_ptq_calibrates_evaluates_and_saves_without_a_step(self):
        data = os.path.join(self.d, "data")
        tt.run(["datagen", "--out", data, "--scenes", "6", "--val-scenes", "2", "--threads", "2",
                "--samples-per-pixel", "1"])
        load = self.base(f"data.path={data}")
        self.bev("ptq", f"data.path={data}", load, "qat.enabled=true", "qat.mode=ptq",
                 "qat.calibrator=percentile", "qat.calib_batches=2", "train.steps=5",
                 "precision.mode=bf16", "qat.sensitivity=true")
        run_dir = os.path.join(self.d, "ptq")
        self.assertEqual(tt.metrics(run_dir), [], "ptq takes no optimizer step")
        prep = tt.metrics(run_dir, "prepare")
        self.assertEqual(len(prep), 1)
        self.assertEqual(prep[0]["step"], 0)
        self.assertGreater(prep[0]["calib_layers"], 10)
        # Linear/Conv layers have an input and a weight quantizer, residual Adds one shared one.
        adds = prep[0]["calib_adds"]
        self.assertGreater(adds, 0)  # bev_tiny's conv backbone and BEV encoder blocks
        self.assertEqual(prep[0]["calib_quantizers"], 2 * prep[0]["calib_layers"] - adds)
        self.assertEqual(prep[0]["calib_unseen"], 0)
        self.assertGreater(prep[0]["calib_amax_min"], 0)
        self.assertLessEqual(prep[0]["calib_amax_min"], prep[0]["calib_amax_max"])
        evals = tt.metrics(run_dir, "eval")
        self.assertEqual([r["step"] for r in evals], [0])
        self.assertIn("miou", evals[0])
        # The sensitivity report: fp32, fully quantized, and one unit quantized at a time.
        with open(os.path.join(run_dir, "sensitivity.json")) as f:
            rep = json.load(f)
        self.assertIn("miou", rep["fp32"])
        self.assertIn("map", rep["quantized_drop"])
        self.assertGreaterEqual(len(rep["units"]), 4)
        self.assertIn("heads", [u["unit"] for u in rep["units"]])
        self.assertEqual(sum(u["layers"] for u in rep["units"]), prep[0]["calib_layers"])
        for u in rep["units"]:
            self.assertAlmostEqual(u["drop"]["miou"], rep["fp32"]["miou"] - u["metrics"]["miou"], places=6)
        self.assertEqual(prep[0]["sensitivity_evals"], len(rep["units"]) + 2)
        ck = os.path.join(run_dir, "checkpoints", "step_00000000")
        meta = metadata(ck)
        amax = [k for k in meta["tensors"] if k.endswith("_quantizer.amax")]
        self.assertEqual(len(amax), prep[0]["calib_quantizers"])
        self.assertEqual(meta["extra"]["qat.calibrator"], "percentile")
        # No step: the weights are the fp32 run's, bitwise.
        base, ptq = tt.weights(os.path.join(self.d, "base")), tt.weights(run_dir)
        for k, v in base.items():
            self.assertTrue(np.array_equal(ptq[k], v), k)
        self.assertEqual(sorted(set(ptq) - set(base)), sorted(k[len("model/"):] for k in amax))
        # `parallax eval` takes the QAT checkpoint (fake-quantized forward).
        p = tt.run(["eval", "--config", tt.BEV, "--checkpoint", ck, f"data.path={data}", "train.device=cpu",
                    "data.batch_size=2", "qat.enabled=true"])
        self.assertIn("miou", p.stdout)
        # The ONNX export writes QuantizeLinear/DequantizeLinear on the input (per tensor) and the
        # weight (per output channel, axis 0) of every quantized layer, and passes the QAT parity
        # gate against the fake-quantized LibTorch forward (ONNX Runtime, 4 frames).
        p = tt.run(["export", "--run", run_dir, "--format", "onnx", "--parity-frames", "4"])
        self.assertIn("PASS", p.stdout)
        import onnx
        g = onnx.load(os.path.join(run_dir, "export", "model.onnx")).graph
        q = [n for n in g.node if n.op_type == "QuantizeLinear"]
        dq = [n for n in g.node if n.op_type == "DequantizeLinear"]
        self.assertEqual(len(q), prep[0]["calib_quantizers"] + adds)  # an Add's quantizer: 2 pairs
        self.assertEqual(len(dq), len(q))
        axis = [n for n in q if any(a.name == "axis" and a.i == 0 for a in n.attribute)]
        self.assertEqual(len(axis), prep[0]["calib_layers"] - adds)  # the weights
        # Every Conv / MatMul / Gemm of a quantized layer reads a DequantizeLinear output.
        produced_by = {o: n.op_type for n in g.node for o in n.output}
        convs = [n for n in g.node if n.op_type == "Conv"]
        self.assertTrue(convs)
        for n in convs:
            self.assertEqual(produced_by.get(n.input[0]), "DequantizeLinear", n.name)
            self.assertEqual(produced_by.get(n.input[1]), "DequantizeLinear", n.name)
        # Every residual Add reads two DequantizeLinear outputs of one scale (TensorRT's INT8 Add).
        from onnx import numpy_helper
        consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        consts.update({n.output[0]: numpy_helper.to_array(a.t) for n in g.node if n.op_type == "Constant"
                       for a in n.attribute if a.name == "value"})
        node_of = {o: n for n in g.node for o in n.output}
        q_adds = [n for n in g.node if n.op_type == "Add"
                  and all(produced_by.get(i) == "DequantizeLinear" for i in n.input)]
        self.assertEqual(len(q_adds), adds)
        for n in q_adds:
            a, b = (consts[node_of[i].input[1]] for i in n.input)
            self.assertEqual(a.shape, ())
            self.assertEqual(float(a), float(b), n.name)
        # fp16 Q/DQ needs opset 19: refused naming the key.
        p = tt.run(["export", "--run", run_dir, "--format", "onnx", "--dtype", "fp16",
                    "--parity-frames", "0"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("fp32", p.stderr)

    def test_qat_on_two_ranks_agrees_on_amax_and_resumes_bitwise(self):
        load = self.base("data.synthetic=true")
        qat = ["data.synthetic=true", load, "qat.enabled=true", "qat.calibrator=mse", "qat.calib_batches=2",
               "qat.skip=['heads.seg_out']"]
        os.environ["PARALLAX_LOG_ALL_RANKS"] = "1"
        try:
            p = self.bev("q", *qat, "train.steps=4", "checkpoint.every=2", "train.activation_checkpointing=full",
                         ranks=2)
            # A resume from step 2: loads every amax, calibrates nothing, repeats steps 3-4 bitwise.
            step2 = os.path.join(self.d, "q", "checkpoints", "step_00000002")
            r = self.bev("r", *qat, "train.steps=4", f"train.resume={step2}", "train.activation_checkpointing=full",
                         ranks=2)
        finally:
            del os.environ["PARALLAX_LOG_ALL_RANKS"]
        prints = re.findall(r"amax fingerprint ([0-9a-f]{8})", p.stdout + p.stderr)
        self.assertEqual(len(prints), 2, (p.stdout + p.stderr)[-3000:])
        self.assertEqual(prints[0], prints[1], "the ranks calibrated different amax")
        # ZeRO-3 (parameters sharded, gathered whole for the calibration): the same amax, bitwise.
        os.environ["PARALLAX_LOG_ALL_RANKS"] = "1"
        try:
            z = self.bev("z", *qat, "train.steps=2", "parallel.zero.stage=3", ranks=2)
        finally:
            del os.environ["PARALLAX_LOG_ALL_RANKS"]
        self.assertEqual(re.findall(r"amax fingerprint ([0-9a-f]{8})", z.stdout + z.stderr), prints)
        self.assertTrue(all(np.isfinite(x["loss"]) for x in tt.metrics(os.path.join(self.d, "z"))))
        rows = tt.metrics(os.path.join(self.d, "q"))
        self.assertEqual([x["step"] for x in rows], [1, 2, 3, 4])
        self.assertTrue(all(np.isfinite(x["loss"]) for x in rows))
        self.assertEqual(len(tt.metrics(os.path.join(self.d, "q"), "prepare")), 1)
        self.assertNotIn("amax fingerprint", r.stdout + r.stderr)
        self.assertIn("no calibration", r.stdout + r.stderr)
        a = {x["step"]: x["loss"] for x in rows}
        b = {x["step"]: x["loss"] for x in tt.metrics(os.path.join(self.d, "r"))}
        self.assertEqual(sorted(b), [3, 4])
        for s in b:
            self.assertEqual(a[s], b[s], f"step {s}")
        wa, wb = tt.weights(os.path.join(self.d, "q")), tt.weights(os.path.join(self.d, "r"))
        for k in wa:
            self.assertTrue(np.array_equal(wa[k], wb[k]), k)
        # The skipped layer has no quantizer.
        self.assertFalse(any(k.startswith("heads.seg_out.") and "quantizer" in k for k in wa))
        self.assertTrue(any(k.startswith("heads.heat_out.input_quantizer") for k in wa))

    def test_bad_inputs_are_one_clear_error_line(self):
        load = self.base("data.synthetic=true")
        common = ["data.synthetic=true", "qat.enabled=true", "train.steps=1"]
        cases = [
            ([load, "qat.calibrator=minmax"], 1, "qat.calibrator"),
            ([load, "qat.skip=['*.nothing']"], 1, "key 'qat.skip': '*.nothing' matches no"),
            ([], 1, "key 'train.load_from'"),
            ([load, "model.backbone=vit", "parallel.tp=2"], 2, "keys 'qat.enabled' and 'parallel.tp'"),
        ]
        for i, (extra, ranks, msg) in enumerate(cases):
            p = self.bev(f"bad{i}", *common, *extra, ranks=ranks, check=False)
            self.assertNotEqual(p.returncode, 0, extra)
            lines = [l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]
            self.assertTrue(lines, p.stderr[-2000:])
            self.assertEqual(len(set(lines)), 1, lines)  # under mpirun every rank prints the same line
            self.assertIn(msg, lines[0])


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)
