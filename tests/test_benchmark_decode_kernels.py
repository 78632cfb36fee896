"""`benchmarks/decode_kernels.py --smoke`: every path of both tables runs on CPU and agrees with its reference."""

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_kernels")


def test_smoke_times_every_path_for_both_shapes(bench, capsys):
    rows = bench.main(["--smoke", "--attention-configs", "64:512:4:fixed,32:256:8:live"])
    initial, reset_4 = bench.SHAPES
    mlp = {(initial, "unfused"), (initial, "fused_mlp kernel (not taken)"),
           (reset_4, "unfused"), (reset_4, "fused_mlp")}  # fmt: skip
    assert {(r["shape"], r["path"]) for r in rows if r["table"] == "mlp"} == mlp
    attention = {(r["shape"], r["path"]) for r in rows if r["table"] == "attention"}
    assert attention == {(d, c) for d in ("200", "2000", "4096") for c in ("64:512:4:fixed", "32:256:8:live")}
    for row in rows:
        assert row["us"] > 0
        if row["table"] == "attention":  # bf16 inputs against the float32 reference
            assert row["difference"] < 1e-2, row
        else:  # bf16 outputs: the rounding of gate/up and float32 summation order may move one by a few ulps
            assert row["difference"] <= 2**-3, row
    assert any(row["difference"] > 0 for row in rows if row["path"].startswith("fused_mlp"))  # other kernels ran
    assert "| reset-4 64 rows r64 all-linear | fused_mlp |" in capsys.readouterr().out


def test_bad_settings_are_refused(bench):
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed"):
        bench.main(["--smoke", "--attention-configs", "64:512:4:dynamic"])
