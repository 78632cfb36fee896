"""`benchmarks/lora_a_tiles.py`: the settings grid, and the CPU smoke run's table (no kernel runs without CUDA)."""

from _benchmarks import load_benchmark


def test_settings_grid_and_smoke_table(tmp_path):
    bench = load_benchmark("lora_a_tiles")
    assert bench.settings_grid("16,32", "16", "128", "2,4") == [(16, 16, 128, 2), (16, 16, 128, 4),
                                                                (32, 16, 128, 2), (32, 16, 128, 4)]  # fmt: skip
    rows = bench.main(["--smoke", "--blocks-m", "16", "--blocks-r", "16,32", "--blocks-k", "128", "--warps", "4",
                       "--out", str(tmp_path / "a.md")])  # fmt: skip
    assert rows == []
    table = (tmp_path / "a.md").read_text()
    assert "| rows | method | BLOCK_M, BLOCK_R, BLOCK_K, warps | us a layer | kernel alone (us) | matches |" in table
    assert "2 settings not run" in table


def test_a_failing_setting_is_one_table_cell():
    """`_common.error_line`, which the tile scripts put in a failed setting's row: the type and the first line, cut
    to 200 characters; an exception without a message (where `splitlines()[0]` would raise) gives its repr."""
    common = load_benchmark("_common")
    assert common.error_line(RuntimeError("out of resources\nshared memory 232448")) == "RuntimeError: out of resources"
    assert common.error_line(ValueError("x" * 300)) == "ValueError: " + "x" * 200
    assert common.error_line(AssertionError()) == "AssertionError()"
