"""`benchmarks/decode_attention_tiles.py --smoke`: the attention reference runs on CPU and the table is formed; the
settings grid puts the engine's own setting first, once."""

from _benchmarks import load_benchmark

from prorl_trl.rollout import decode_attention


def test_smoke_run_times_every_live_length_and_renders_the_table(tmp_path):
    bench = load_benchmark("decode_attention_tiles")
    rows = bench.main(["--smoke", "--live", "64,256,9999", "--out", str(tmp_path / "tiles.md")])
    assert len(rows) == 1 and "error" not in rows[0], rows  # on CPU: the engine's setting, through the reference
    row = rows[0]
    assert row["max_error"] == 0.0  # the reference against itself
    assert row[64] > 0 and row[256] > 0 and 9999 not in row  # a length past the cache is clipped to it
    table = (tmp_path / "tiles.md").read_text()
    assert "| programs | block | warps | stages | 64 live | 256 live | max error |" in table
    engine = f"| {decode_attention.TARGET_PROGRAMS} | {decode_attention.BLOCK_N} | {decode_attention.NUM_WARPS} | - |"
    assert engine in table


def test_settings_grid_starts_with_the_engine_setting():
    bench = load_benchmark("decode_attention_tiles")
    grid = bench.settings_grid("512,1024", "64", "4,8", "-,2")
    engine = {"programs": decode_attention.TARGET_PROGRAMS, "block": decode_attention.BLOCK_N,
              "warps": decode_attention.NUM_WARPS, "stages": None}  # fmt: skip
    assert grid[0] == engine and grid.count(engine) == 1
    assert len(grid) == 2 * 1 * 2 * 2  # the engine's setting is one of the 8 combinations: listed first, not twice
    assert {setting["stages"] for setting in grid} == {None, 2}
