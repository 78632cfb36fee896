"""GPU: ProRLTrainer hard resets under FSDP2 and DeepSpeed ZeRO-3 on 2 GPUs (benchmarks/scale_out.py's 2-GPU cases).

Skipped without 2 CUDA GPUs and DeepSpeed; the CPU suite covers ZeRO-2/3 over gloo and the FSDP2 mechanics
(tests/test_sharded_resets.py). Results of the full matrix: benchmarks/results/scale_out.md.
"""

import json

import pytest
import torch
from _benchmarks import load_benchmark

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_fsdp2_and_zero3_resets_on_two_gpus(tmp_path):
    pytest.importorskip("deepspeed")
    scale_out = load_benchmark("scale_out")
    scale_out.main(["--cases", "zero3:2,fsdp2:2", "--budget", "600", "--json-dir", str(tmp_path)])
    results = json.loads((tmp_path / "scale_out.json").read_text())
    modes = ("full", "lora", "lora_merge")
    assert {(r["engine"], r["mode"]) for r in results} == {(e, m) for e in ("zero3", "fsdp2") for m in modes}
    for result in results:
        assert "error" not in result, result["error"]
        verdict = scale_out.verdicts(result, smoke=False)
        assert verdict["a"] and verdict["c"], (result["engine"], result["mode"], verdict)
        if result["mode"] == "full":  # the policy is not edited: exactly unchanged
            assert verdict["logits"] == 0.0
        elif result["mode"] == "lora":  # frozen factors (the default) on a bf16 base: the base is never written and
            # the reset moves the logits no more than bf16 evaluation noise (the engine's bf16 logits vs the same
            # policy in float32); the live adapter is computed in bf16 under both engines, the frozen parts in float32
            assert verdict["reset_mode"] == "frozen" and verdict["base_kept"], verdict
            assert verdict["b"] and verdict["within_noise"], verdict
            assert all(len(set(c["frozen_hashes"])) == 1 for c in result["resets"])
        else:  # lora_merge, for comparison: merging a small delta into bf16 rounds most of it away
            # (benchmarks/results/scale_out.md); the fp32 bar (1e-5) is tested on CPU (tests/test_sharded_resets.py)
            assert verdict["reset_mode"] == "merge" and verdict["merge_lost"] is not None, verdict
