"""`benchmarks/decode_kernels.py --smoke`: every path of the three tables runs on CPU and agrees with its reference."""

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_kernels")


def test_smoke_times_every_path_for_both_shapes(bench, capsys):
    attention_configs = "64:512:4:fixed,32:256:8:live"
    rows = bench.main(["--smoke", "--layouts", "32:264:2,64:132:1", "--attention-configs", attention_configs])
    lora = {(shape, path, layout) for shape in bench.SHAPES
            for path, layout in (("reductions", "-"), ("cublas", "-"), ("gemm", "32:264:2"), ("gemm", "64:132:1"))}
    initial, reset_4 = bench.SHAPES
    mlp = {(initial, "unfused", "-"), (initial, "fused_mlp", "-")} | {
        (reset_4, path, layout) for path, layout in (("unfused", "-"), ("unfused + lora_gemm", "default"),
                                                      ("fused_mlp", "-"), ("fused_mlp + lora_gemm", "default"))}
    assert {(r["shape"], r["path"], r["layout"]) for r in rows if r["table"] == "lora"} == lora
    assert {(r["shape"], r["path"], r["layout"]) for r in rows if r["table"] == "mlp"} == mlp
    attention = {(r["shape"], r["path"]) for r in rows if r["table"] == "attention"}
    assert attention == {(d, c) for d in ("200", "2000", "4096") for c in ("64:512:4:fixed", "32:256:8:live")}
    for row in rows:
        assert row["us"] > 0
        if row["table"] == "attention":  # bf16 inputs against the float32 reference
            assert row["difference"] < 1e-2, row
            continue
        # bf16 outputs: float32 summation order (and, in the MLP, the rounding of gate/up) may move one by an ulp
        assert row["difference"] <= (2**-5 if row["table"] == "lora" else 2**-3), row
    assert sum(row["difference"] > 0 for row in rows if row["path"] not in ("reductions", "unfused")) > 0
    out = capsys.readouterr().out
    assert "| reset-4 64 rows r64 all-linear | gemm | 64:132:1 |" in out and "| fused_mlp + lora_gemm |" in out


def test_bad_settings_are_refused(bench):
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:MIN_SLICES_PER_SPLIT"):
        bench.main(["--smoke", "--layouts", "32:264"])
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed"):
        bench.main(["--smoke", "--attention-configs", "64:512:4:dynamic"])
