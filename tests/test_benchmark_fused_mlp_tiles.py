"""`benchmarks/fused_mlp_tiles.py --smoke`: the tile table runs on CPU (torch ops) and is well formed."""

from _benchmarks import load_benchmark


def test_smoke_run_renders_one_table_per_row_count(tmp_path):
    bench = load_benchmark("fused_mlp_tiles")
    rows = bench.main(["--smoke", "--out", str(tmp_path / "tiles.md")])
    assert [row["setting"] for row in rows] == [(32, 128, 4, 3, "bf16x3")]
    assert rows[0]["us"] > 0 and rows[0]["differing"] == 0 and rows[0]["error"] < 1e-2
    assert rows[0]["default"]  # 4 rows: BLOCK_M 16, the tiles of commit 1c1b24d
    table = (tmp_path / "tiles.md").read_text()
    assert "**4 rows** (BLOCK_M 16)" in table and "| 32:128:4:3:bf16x3 |" in table and "torch ops (smoke)" in table
