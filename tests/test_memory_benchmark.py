"""The per-phase memory benchmark (benchmarks/memory.py) runs in its CPU smoke mode, and its committed table is what its
committed worker results give."""

import json

import pytest
from _benchmarks import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results"


@pytest.fixture(scope="module")
def benchmark():
    return load_benchmark("memory")


def rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]


def test_smoke_measures_every_recipe_phase_at_fixed_lengths(benchmark, tmp_path, capsys):
    out = tmp_path / "memory.md"
    table = benchmark.main(["--smoke", "--out", str(out)])
    assert table in capsys.readouterr().out and table in out.read_text()
    body = rows(table)
    assert [row[0].split(" (")[0] for row in body] == ["0 initial", "1 reset-1", "2 reset-2", "3 reset-3", "4 reset-4"]
    for row in body:
        caps = row[1].split(" x ")[1]
        assert row[6] == f"{caps} / {caps}"  # both trainers generated every completion to the phase's cap
        assert float(row[5]) > 0 and row[7] in ("yes", "**no**") and row[8] in ("yes", "**no**")
    assert body[4][1] == "16 x 16" and body[4][2].startswith("r8 ") and body[0][2] == "r4 k,q"


def test_worker_processes_write_json_and_a_later_start_maps_to_its_phases(benchmark, tmp_path):
    folder = tmp_path / "runs"
    argv = ["--smoke", "--jobs", "2", "--workers", "prorl,grpo:4", "--prorl-from", "3", "--json-dir", str(folder)]
    table = benchmark.main(argv)
    prorl = json.loads((folder / "prorl.json").read_text())
    assert prorl["first_phase"] == 3 and len(prorl["records"]) == 2  # reset-3 and reset-4
    assert [phase["name"] for phase in prorl["resolved"]] == ["reset-3", "reset-4"]
    assert prorl["resolved"][0]["top_p"] == 1.0 and prorl["resolved"][0]["temperature"] == 1.2  # as in the full run
    body = rows(table)
    assert body[0][3] == "not run" and body[0][4] == "not run"
    assert body[4][4].endswith("(run from phase 3)") and body[4][5] != "n/a"
    assert benchmark.main(["--from-json", str(folder / "prorl.json"), str(folder / "grpo_4.json")]) == table


def test_a_later_start_alone_reports_its_phases_under_their_own_numbers(benchmark, tmp_path):
    """Only `--workers prorl --prorl-from 3`: rows 3 and 4 carry its measurements (not 'not run' under 0 and 1)."""
    folder = tmp_path / "runs"
    table = benchmark.main(["--smoke", "--workers", "prorl", "--prorl-from", "3", "--json-dir", str(folder)])
    body = rows(table)
    assert [row[0].split(" (")[0] for row in body] == ["3 reset-3", "4 reset-4"]
    assert all(row[4].endswith("(run from phase 3)") and row[3] == "not run" for row in body)


def test_unknown_worker_is_refused(benchmark):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--smoke", "--workers", "prorl,grpo:9"])
    assert exit_info.value.code == 2


def test_committed_table_is_what_the_committed_runs_give(benchmark):
    runs = RESULTS / "memory_runs"
    names = ["grpo_0", "grpo_1", "grpo_2", "grpo_3", "grpo_4", "prorl_phases_0-3", "prorl_from_phase_3"]
    table = benchmark.main(["--from-json", *[str(runs / f"{name}.json") for name in names]])
    assert table in (RESULTS / "memory.md").read_text()
    assert all(row[7] == "yes" and row[8] == "yes" for row in rows(table))


def test_segment_reports_show_what_cuts_a_segment(benchmark):
    """The allocator-segment summaries (`segments`, `--trace-segments`) read `torch.cuda.memory._snapshot()`'s layout:
    a free run cut by a small live block stays two runs (that cut is what the report is for), private pools are left
    out of the block report and counted apart in the summary."""
    mib = 2**20
    path = "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py"
    frames = [{"filename": path, "line": 97, "name": "forward"}]
    snapshot = {"segments": [
        {"total_size": 200 * mib, "allocated_size": 50 * mib + mib // 2, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "blocks": [
             {"size": 100 * mib, "state": "inactive"}, {"size": mib // 2, "state": "active_allocated"},
             {"size": 10 * mib, "state": "inactive"}, {"size": 50 * mib, "state": "active_allocated", "frames": frames},
             {"size": 39 * mib + mib // 2, "state": "inactive"}]},
        {"total_size": 72 * mib, "allocated_size": 0, "stream": 7, "segment_type": "large", "segment_pool_id": (1, 2),
         "blocks": [{"size": 72 * mib, "state": "inactive"}]},
    ]}  # fmt: skip
    report = benchmark.segment_blocks(snapshot)
    live = "50.0 MiB transformers/models/qwen2/modeling_qwen2.py:97 forward"
    assert report == [{"mib": 200.0, "stream": "0x0", "blocks": [100.0, "0.5 MiB small", 10.0, live, 39.5]}]
    summary = benchmark.segment_summary(snapshot["segments"])
    assert summary["by_stream_and_pool"] == {
        "stream 0x0, default pool, large": {"segments": 1, "reserved": 200 * mib, "allocated": 50 * mib + mib // 2},
        "stream 0x7, private pool, large": {"segments": 1, "reserved": 72 * mib, "allocated": 0},
    }
    assert [entry["mib"] for entry in summary["largest"]] == [200.0, 72.0]
    free_segment = {"total_size": 20 * mib, "allocated_size": 0, "stream": 0, "segment_type": "large",
                    "segment_pool_id": (0, 0), "blocks": [{"size": 20 * mib, "state": "inactive"}]}  # fmt: skip
    side = {"total_size": 2 * mib, "allocated_size": 512, "stream": 9, "segment_type": "small",
            "segment_pool_id": (0, 0), "blocks": [{"size": 512, "state": "active_allocated", "frames": frames},
                                                  {"size": 2 * mib - 512, "state": "inactive"}]}  # fmt: skip
    assert benchmark.side_stream_blocks({"segments": [*snapshot["segments"], side]}) == [
        {"bytes": 512, "origin": "transformers/models/qwen2/modeling_qwen2.py:97 forward",
         "frames": ["modeling_qwen2.py:97 forward"]}]  # fmt: skip
    space = benchmark.free_space({"segments": [*snapshot["segments"], free_segment]})
    assert space == {"allocated": 50.5, "free_in_used_segments": 149.5, "free_segments": 20.0, "private_pools": 72.0,
                     "largest_free_run": 100.0}  # fmt: skip


def test_switches_set_boolean_rollout_switches_and_refuse_anything_else(benchmark):
    from prorl_trl.rollout import arena

    before = arena.PRIVATE_POOL
    try:
        assert benchmark.apply_switches(["arena.PRIVATE_POOL=false"]) == {"arena.PRIVATE_POOL": False}
        assert arena.PRIVATE_POOL is False
    finally:
        arena.PRIVATE_POOL = before
    for bad in ("arena.ALIGN=true", "arena.NOPE=true", "nomodule.X=true", "arena.PRIVATE_POOL=maybe"):
        with pytest.raises(SystemExit, match="--switch"):
            benchmark.apply_switches([bad])
