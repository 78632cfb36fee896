"""`benchmarks/small_product_precision.py`: the settings it times, and the CPU smoke run's table (no kernel runs
without CUDA)."""

from _benchmarks import load_benchmark


def test_settings_and_smoke_table(tmp_path):
    bench = load_benchmark("small_product_precision")
    settings = bench.settings_for(896)
    assert settings and all(896 % s[5] == 0 and (896 // s[5]) % s[2] == 0 for s in settings)
    assert bench.settings_for(100) == []  # no setting splits 100 features into whole blocks
    rows = bench.main(["--smoke", "--out", str(tmp_path / "p.md")])
    assert rows == []
    table = (tmp_path / "p.md").read_text()
    header = "| mode | BLOCK_M, BLOCK_R, BLOCK_K, warps, stages | feature splits | programs | us a layer | error |"
    assert header in table
    assert f"{len(bench.MODES)} modes x {len(settings)} settings not run" in table
