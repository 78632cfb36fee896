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
    base = {(r["shape"].split(",")[0], r["path"], r["layout"]) for r in rows if r["table"] == "base"}
    assert base == {(f"{n} rows", p, l) for n in (32, 64) for p, l in (("cublas", "-"), ("skinny", "32:264:2"),
                                                                        ("skinny", "64:132:1"))}  # fmt: skip
    assert len([r for r in rows if r["table"] == "base"]) == 2 * len(bench.PROJECTIONS) * 3
    attention = {(r["shape"], r["path"]) for r in rows if r["table"] == "attention"}
    assert attention == {(d, c) for d in ("200", "2000", "4096") for c in ("64:512:4:fixed", "32:256:8:live")}
    for row in rows:
        assert row["us"] > 0
        if row["table"] == "attention":  # bf16 inputs against the float32 reference
            assert row["difference"] < 1e-2, row
            continue
        if row["table"] == "base":  # on the CPU both are F.linear
            assert row["difference"] == 0, row
            continue
        # bf16 outputs: float32 summation order (and, in the MLP, the rounding of gate/up) may move one by an ulp
        assert row["difference"] <= (2**-5 if row["table"] == "lora" else 2**-3), row
    assert sum(row["difference"] > 0 for row in rows if row["path"] not in ("reductions", "unfused", "cublas")) > 0
    out = capsys.readouterr().out
    assert "| reset-4 64 rows r64 all-linear | gemm | 64:132:1 |" in out and "| fused_mlp + lora_gemm |" in out


def test_bad_settings_are_refused(bench):
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:MIN_SLICES_PER_SPLIT"):
        bench.main(["--smoke", "--layouts", "32:264"])
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed"):
        bench.main(["--smoke", "--attention-configs", "64:512:4:dynamic"])
