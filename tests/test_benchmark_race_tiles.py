"""`benchmarks/race_tiles.py`: the settings grid, and the CPU smoke run's table (no kernel runs without CUDA)."""

from _benchmarks import load_benchmark


def test_settings_grid_and_smoke_table(tmp_path):
    bench = load_benchmark("race_tiles")
    assert bench.settings_grid("512,1024", "256", "2,4") == [(512, 256, 2), (512, 256, 4), (1024, 256, 2),
                                                              (1024, 256, 4)]  # fmt: skip
    rows = bench.main(["--smoke", "--programs", "512", "--blocks", "256,512", "--warps", "4", "--out",
                       str(tmp_path / "race.md")])  # fmt: skip
    assert rows == []
    table = (tmp_path / "race.md").read_text()
    assert "| rows | programs | block | warps | after top-p (us) | same | on the logits (us) | same |" in table
    assert "2 settings not run" in table
