"""`benchmarks/step_time.py --smoke` on CPU (the engine forced on, graphs off).

Phases mode: one run times the Initial and reset-4 phases (reset-1..3 entered without a step, their hard resets done)
and checks the split of every step, the completions at the cap, the resets behind reset-4 and the table; `--from-json`
joins two runs, `--budget-s` still prints the table. Paths mode: the three paths train and the table renders with the
vanilla extrapolation. On 2 CPU cores shared at load 10 (2026-11-28): the phases run 152 s, the paths run 59 s, the
rest under 1 s.
"""

import json

import pytest
from _benchmarks import load_benchmark

NAMES = ["initial", "reset-1", "reset-2", "reset-3", "reset-4"]


@pytest.fixture(scope="module")
def phases_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("step_time")
    bench = load_benchmark("step_time")
    argv = ["--smoke", "--phases", "initial,reset4", "--steps-per-phase", "2", "--prompt-tokens", "16", "--profile-decode"]
    result = bench.main(argv + ["--json", str(folder / "run.json"), "--out", str(folder / "table.md")])
    return bench, folder, result


def test_phases_smoke_splits_every_step_and_times_phases_at_the_recipe_shapes(phases_run):
    bench, folder, result = phases_run
    assert "error" not in result, result.get("error")
    rows = {row["name"]: row for row in result["phases"]}
    assert set(rows) == {"initial", "reset-4"} and result["names"] == NAMES
    initial, last = rows["initial"], rows["reset-4"]
    # memory.SMOKE_OVERRIDES: the recipe's structure at tiny sizes (reset-4: longer cap, bigger group, wider LoRA)
    assert (initial["batch"], initial["group"], initial["cap"], initial["lora"]["r"]) == (8, 4, 12, 4)
    assert (last["batch"], last["group"], last["cap"], last["lora"]["r"], last["overlong_buffer"]) == (16, 8, 16, 8, 8)
    assert (initial["recipe_max_steps"], last["recipe_max_steps"]) == (300, 200)  # the recipe's, not the cut phase's
    assert last["steps_per_generation"] == 2 and initial["steps_per_generation"] == 1
    # the four frozen resets before reset-4 were really done, one frozen part per q/k layer per reset
    assert initial["resets_before"] == 0 and initial["frozen_parts"] == 0
    assert last["resets_before"] == 4 and last["frozen_layers"] > 0
    assert last["frozen_parts"] == 4 * last["frozen_layers"]
    for row in (initial, last):
        assert len(row["steps"]) == 2
        for step in row["steps"]:
            # the timed parts nest inside the step and account for most of it; the rest ("other": logging,
            # callbacks) is a few ms that a loaded CI machine can stretch to 10-20% of a 0.15 s tiny step
            measured = sum(step["split"][part] for part in bench.PARTS)
            assert 0.5 * step["seconds"] <= measured <= step["seconds"] + 1e-3, (row["name"], step)
            assert min(step["split"][part] for part in ("loss_forward", "backward", "optimizer")) > 0, step
            if step["tokens"]:  # every completion ran to the phase's cap
                assert step["tokens"] == row["batch"] * row["cap"] and step["rollout_seconds"] > 0
        assert row["steps"][0]["tokens"] and row["steps"][0]["split"]["generation"] > 0
    assert "no CUDA graph" in result["profile"]["skipped"]
    table = (folder / "table.md").read_text()
    assert "**Every completion runs to its phase's cap**" in table and "Device: CPU (smoke)" in table
    summary = bench.phase_summary(initial)
    assert "| 0 initial (T=1.0, top_p=0.7) | 8 (2 x 4) x 12 | r4 a8 k,q (0: 0) |" in table
    assert f"| 300 | {summary['phase_seconds'] / 3600:.1f} h |" in table
    assert "| 1 reset-1 | not measured |" in table and "without reset-1, reset-2, reset-3 (not measured)" in table
    assert "reset-1 2,300, reset-2 200, reset-3 200, reset-4 4,600 = 7,600 steps" in table


def test_from_json_joins_runs_made_on_different_machines(phases_run, capsys):
    bench, folder, _ = phases_run
    run = json.loads((folder / "run.json").read_text())
    first = dict(run, phases=[r for r in run["phases"] if r["name"] == "initial"])
    second = dict(run, phases=[r for r in run["phases"] if r["name"] == "reset-4"], meta=dict(run["meta"], device="GPU B"))
    (folder / "a.json").write_text(json.dumps(first))
    (folder / "b.json").write_text(json.dumps(second))
    bench.main(["--from-json", str(folder / "a.json"), str(folder / "b.json"), "--out", str(folder / "joined.md")])
    joined = (folder / "joined.md").read_text()
    assert "Device: CPU (smoke); GPU B |" in joined
    assert "| 0 initial (T=1.0" in joined and "| 4 reset-4 (T=1.2" in joined and "| 2 reset-2 | not measured |" in joined


def test_plan_and_phase_options():
    bench = load_benchmark("step_time")
    assert bench.pick_phases("reset4,Initial,2", NAMES) == [0, 2, 4] and bench.pick_phases(None, NAMES) == [0, 1, 2, 3, 4]
    with pytest.raises(SystemExit, match="unknown phase 'reset5'"):
        bench.pick_phases("reset5", NAMES)
    recipe = [300, 200, 200, 200, 200]
    assert bench.seed_plan_lengths("reset-1=2600,reset-4=7600", NAMES, recipe) == [300, 2300, 200, 200, 4600]
    assert bench.seed_plan_lengths("", NAMES, recipe) == recipe
    with pytest.raises(SystemExit, match="would end before it starts"):
        bench.seed_plan_lengths("reset-1=300", NAMES, recipe)


def test_budget_spent_skips_the_phase_and_still_prints_the_table(tmp_path):
    bench = load_benchmark("step_time")
    argv = ["--smoke", "--phases", "reset4", "--steps-per-phase", "1", "--budget-s", "0", "--out", str(tmp_path / "t.md")]
    result = bench.main(argv)
    assert [(row["name"], row["error"], row["resets_before"]) for row in result["phases"]] == [
        ("reset-4", "skipped: --budget-s reached", 4)
    ]
    assert "| 4 reset-4 | skipped: --budget-s reached |" in (tmp_path / "t.md").read_text()


def test_paths_smoke_trains_every_path_and_renders_the_table(tmp_path):
    bench = load_benchmark("step_time")
    argv = ["--smoke", "--paths", "rollout_engine,compiled_generation,vanilla", "--steps", "2", "--vanilla-cap", "4"]
    result = bench.main(argv + ["--out", str(tmp_path / "t.md")])
    rows = {row["path"]: row for row in result["results"]}
    assert set(rows) == {"rollout_engine", "compiled_generation", "vanilla"}
    for row in rows.values():
        assert "error" not in row, row
        assert len(row["step_seconds"]) == 2 and len(row["generate_seconds"]) >= 2
    assert rows["vanilla"]["cap"] == 4 and rows["rollout_engine"]["cap"] == 6
    assert rows["rollout_engine"]["mean_completion_length"] == 6  # min_new_tokens: completions at the cap
    table = (tmp_path / "t.md").read_text()
    assert "| rollout_engine | 6 | 2 |" in table and "vanilla at cap 6 (extrapolated)" in table
