"""`benchmarks/step_time.py --smoke`: the three paths train on CPU (the engine forced on, graphs off) and the table
renders with the vanilla extrapolation. About 15 s."""

from _benchmarks import load_benchmark


def test_smoke_run_trains_every_path_and_renders_the_table(tmp_path):
    bench = load_benchmark("step_time")
    result = bench.main(["--smoke", "--steps", "2", "--vanilla-cap", "4", "--out", str(tmp_path / "t.md")])
    rows = {row["path"]: row for row in result["results"]}
    assert set(rows) == {"rollout_engine", "compiled_generation", "vanilla"}
    for row in rows.values():
        assert "error" not in row, row
        assert len(row["step_seconds"]) == 2 and len(row["generate_seconds"]) >= 2
    assert rows["vanilla"]["cap"] == 4 and rows["rollout_engine"]["cap"] == 6
    assert rows["rollout_engine"]["mean_completion_length"] == 6  # min_new_tokens: completions at the cap
    table = (tmp_path / "t.md").read_text()
    assert "| rollout_engine | 6 | 2 |" in table and "vanilla at cap 6 (extrapolated)" in table
