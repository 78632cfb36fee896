"""`benchmarks/lora_gemm_kernel.py --smoke`: every path runs for both shapes on CPU and agrees with the reductions."""

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("lora_gemm_kernel")


def test_smoke_times_every_path_and_layout_for_both_shapes(bench, capsys):
    rows = bench.main(["--smoke", "--layouts", "32:264:2,64:132:1"])
    expected = {(shape, path, layout) for shape in bench.SHAPES
                for path, layout in (("reductions", "-"), ("cublas", "-"), ("gemm", "32:264:2"), ("gemm", "64:132:1"))}
    assert {(row["shape"], row["path"], row["layout"]) for row in rows} == expected
    for row in rows:
        assert row["us"] > 0
        # bf16 outputs of magnitude < 8: float32 summation order may move one by a bf16 ulp (<= 2**-5 there)
        assert row["difference"] <= 2**-5, row
    assert sum(row["difference"] > 0 for row in rows if row["path"] != "reductions") > 0  # the paths really differ
    assert "| reset-4 64 rows r64 all-linear | gemm | 64:132:1 |" in capsys.readouterr().out


def test_bad_layout_is_refused(bench):
    with pytest.raises(SystemExit, match="BLOCK_N:TARGET_PROGRAMS:MIN_SLICES_PER_SPLIT"):
        bench.main(["--smoke", "--layouts", "32:264"])
