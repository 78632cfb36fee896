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
