"""benchmarks/prolonged.py (issue 29): its statistics against hand-computed values, how it reads rows written by a
resumed run, and its CPU smoke end to end: four arms x two seeds in-process, then `--resume` continuing one run from a
checkpoint in a worker process without touching the others."""

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

from prorl_trl.data.synthetic import make_arithmetic_dataset

prolonged = load_benchmark("prolonged")
gather_tool = load_benchmark("prolonged_gather")


def test_mean_standard_error_and_t_interval_match_hand_computed_values():
    assert prolonged.mean_se([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / math.sqrt(3)))  # sd 1, n 3
    mean, low, high = prolonged.t_interval([1.0, 2.0, 3.0])  # t(2 dof) = 4.303
    assert (mean, low, high) == pytest.approx((2.0, 2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert prolonged.t_interval([0.1, 0.3]) == pytest.approx((0.2, 0.2 - 1.2706, 0.2 + 1.2706))  # se 0.1, t(1) 12.706
    assert prolonged.t_interval([0.0, 0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)
    mean, se = prolonged.mean_se([0.5])
    assert mean == 0.5 and math.isnan(se) and math.isnan(prolonged.t_interval([0.5])[1])
    values = [float(i % 2) for i in range(50)]  # 49 dof: the 40-dof quantile, 2.021 (conservative)
    mean, low, _ = prolonged.t_interval(values)
    assert mean - low == pytest.approx(2.021 * prolonged.mean_se(values)[1])


def test_the_knob_reading_applies_the_pre_set_rule_to_each_metric():
    """A part carries (b)'s effect when its CI against (c) excludes 0 on (b)'s side; the other side is said too; a
    CI holding 0, or none (one seed), is no effect. Records as `pair_line` makes them, from hand-picked differences."""
    def record(*diffs):
        return prolonged.pair_line("x", list(range(len(diffs))), list(diffs))[1]

    pairs = {
        "prorl-no_reset@1": record(0.02, 0.03, 0.025, 0.02),  # (b) above (c) at pass@1, CI above 0
        "opt-no_reset@1": record(0.02, 0.021, 0.023, 0.02),  # carries it
        "ref-no_reset@1": record(0.02, -0.03, 0.01, -0.01),  # CI holds 0
        "adapter-no_reset@1": record(-0.02, -0.021, -0.022, -0.019),  # the other way
        "prorl-no_reset@64": record(-0.04, 0.04, 0.03, -0.01),  # mean 0.005, t(3) 3.182 x s.e. 0.0185: CI holds 0
        "opt-no_reset@64": record(0.01),  # one seed: no interval, no effect
        "adapter-no_reset@64": record(0.02, 0.021, 0.023, 0.02),  # (b)'s sign, but (b) itself holds 0
        "prorl-no_reset@newly_solved": record(-3, -4, -3.5, -3),
        "ref-no_reset@newly_solved": record(-2, -3, -2.5, -2),
        "adapter-no_reset@newly_solved": record(-3, -4, -3.5, -3),
        "prorl-no_reset@newly_lost": record(2, -2, 1, -1),  # a mean of exactly 0: no sign, nothing to carry
        "opt-no_reset@newly_lost": record(-5, -6, -4, -5),  # significant on its own
        "ref-no_reset@newly_lost": record(5, 6, 4, 5),
    }
    lines = prolonged.knob_lines(pairs, [1, 64])
    table = "\n".join(lines)
    assert lines[0].startswith("## Which part of the reset does what")
    assert "| metric | (b) - (c) | opt - (c) | ref - (c) | adapter - (c) |" in table
    assert ("| pass@1 | **+2.4 [+1.6, +3.1] (n=4)** | **+2.1 [+1.9, +2.3] (n=4)** | -0.2 [-3.8, +3.3] (n=4) | **-2.1"
            in table)
    assert "| pass@64 | +0.5 [-5.4, +6.4] (n=4) | +1.0 n/a (n=1) | - | **+2.1 [+1.9, +2.3] (n=4)** |" in table
    assert "- pass@1: (b) - (c) +2.4 pts, significant; opt carries it; adapter moves it the other way." in lines
    assert ("- pass@64: (b) - (c) +0.5 pts, not significant; adapter carries it by the rule's letter, though (b)'s "
            "own difference is not significant: a lead at most." in lines)  # before 2026-11-29: plain "carries it"
    assert "- newly solved: (b) - (c) -3.4 problems, significant; ref, adapter carry it." in lines
    assert "- newly lost: (b) - (c) +0.0 problems, no effect to carry; opt down, ref up significantly, on its own." \
        in lines  # before 2026-11-29 a zero mean read as negative, and opt "carried" an effect (b) does not have
    assert not any(line.startswith("- pass@8") for line in lines)  # no (b) - (c) record: no sentence
    assert prolonged.knob_lines({"prorl-no_reset@1": pairs["prorl-no_reset@1"]}, [1]) == []  # no knob arm run


def test_pass_at_k_up_to_256_and_per_problem_outcomes_match_hand_computed_values(tmp_path):
    """Issue 38: pass@1/8/64/256 below n and n itself; newly solved/lost and pass@1 per number of operations from
    per-problem correct counts; counts that do not match the logged pass@1 are refused, missing ones left out."""
    ks = {n: prolonged.ks_of(prolonged.parse_args(["--out", "x", "--val-samples", str(n)])) for n in (4, 64, 100, 512)}
    assert ks == {4: [1, 4], 64: [1, 8, 64], 100: [1, 8, 64, 100], 512: [1, 8, 64, 256, 512]}
    assert prolonged.ks_of(prolonged.parse_args(["--out", "x"])) == [1, 8, 64, 256]  # the GPU default n
    assert prolonged.newly_solved_and_lost([0, 0, 2, 1, 0], [3, 0, 0, 1, 1]) == (2, 1)
    with pytest.raises(ValueError, match="not the same held-out set"):
        prolonged.newly_solved_and_lost([0, 1], [0])
    assert prolonged.pass1_by_operations([4, 0, 2, 1], 4, [1, 2, 2, 3]) == {1: 1.0, 2: 0.25, 3: 0.25}
    line = {"num_samples": 4, "num_steps": [1, 2, 2, 3]}
    counts = {0: {**line, "step": 0, "correct": [0, 1, 0, 2]}, 8: {**line, "step": 8, "correct": [1, 0, 0, 4]}}
    evals = [{"prorl/global_step": 0, "eval_pass@1": 3 / 16}, {"prorl/global_step": 8, "eval_pass@1": 5 / 16}]
    run = {"arm": "prorl", "seed": 1, "counts": counts, "evals": evals}
    outcomes = prolonged.problem_outcomes(run, 4)
    assert {key: outcomes[key] for key in prolonged.OUTCOMES} == {
        "newly_solved": 1, "newly_lost": 1, "solved_start": 2, "solved_end": 2}  # fmt: skip
    assert outcomes["by_operations"] == {1: 0.25, 2: 0.0, 3: 1.0}
    assert prolonged.problem_outcomes({**run, "counts": {0: counts[0]}}, 4) is None  # no line at the last step
    with pytest.raises(SystemExit, match=r"runs/prorl-s1/counts.jsonl, step 8: .* another validation"):
        prolonged.problem_outcomes({**run, "evals": [evals[0], {**evals[1], "eval_pass@1": 0.5}]}, 4)
    with pytest.raises(SystemExit, match="the report's n is 8"):
        prolonged.problem_outcomes(run, 8)


def test_rows_of_a_resumed_run_keep_the_last_attempt_and_resets_sit_after_their_step(tmp_path):
    rows = [
        {"eval_pass@1": 0.1, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": 0, "_attempt": 0, "_seconds": 1},
        {"reward": 0.0, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": 1, "_attempt": 0, "_seconds": 2},
        {"train_runtime": 3.0, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": 1, "_attempt": 0, "_seconds": 3},
        {"reward": 0.5, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": 2, "_attempt": 0, "_seconds": 4},
        {"reward": 0.6, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": 2, "_attempt": 1, "_seconds": 1},
        {"prorl/phase_start": 1, "prorl/phase": 1, "prorl/resets": 1, "prorl/global_step": 2, "_attempt": 1, "_seconds": 2},
        {"reward": 0.7, "prorl/phase": 1, "prorl/resets": 1, "prorl/global_step": 3, "_attempt": 1, "_seconds": 5},
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"reward": 0.8, "prorl/gl')  # cut last line
    kept = prolonged.read_rows(path)
    assert [row.get("reward") for row in kept if "reward" in row] == [0.0, 0.6, 0.7]
    assert any("train_runtime" in row for row in kept)  # a phase's summary entry does not replace its last step
    assert prolonged.reset_steps(kept) == [2]
    assert prolonged.attempt_seconds(prolonged.read_jsonl(path)) == {0: 4, 1: 5}


def test_smoke_runs_every_arm_and_resume_continues_one_run_from_a_checkpoint(tmp_path):
    result = prolonged.main(["--smoke", "--out", str(tmp_path)])
    report = (tmp_path / "prolonged.md").read_text()
    for label in prolonged.ARMS.values():
        assert f"| {label} | 2 of 2 |" in report
    pairs = ("(b) - (a) pass@1", "(b) - (c) pass@1", "(d) - (a) pass@1", "(b) - (a) pass@4", "opt - (c) pass@1",
             "ref - (c) pass@1", "adapter - (c) pass@1")
    for pair in pairs:
        assert f"- {pair}: " in report and "95% CI [" in report.split(f"- {pair}: ")[1].splitlines()[0]
    assert "## Plateau of arm (a)" in report and "Gain over the last half" in report
    assert "## Which part of the reset does what" in report and "| newly solved | " in report
    assert ", the first at or after step 3), pooled across seeds: validation pass@1" in report
    runs = {f"{arm}-s{seed}" for arm in prolonged.ARMS for seed in (0, 1)}
    assert {p.parent.name for p in (tmp_path / "runs").glob("*/rows.jsonl")} == runs
    assert all((tmp_path / "runs" / run / "done.json").is_file() for run in runs)
    assert {p.name for p in tmp_path.glob("*.png")} >= {"pass1.png", "pass4.png", "entropy.png", "kl.png"}
    resets = {(run["arm"], run["seed"]): run["resets"] for run in result["runs"]}
    assert resets[("prorl", 0)] == [1, 2, 3] and resets[("no_reset", 0)] == [] and resets[("one_phase", 0)] == []
    assert resets[("plateau", 0)], "smoke patience 1: pass@1 stays flat, so the plateau rule resets"
    for knob in ("opt", "ref", "adapter"):  # the same boundaries as (b), each a reset of one part alone
        assert resets[(knob, 0)] == [1, 2, 3], knob
    assert_replicates_reads_the_study(tmp_path)
    assert set(result["pairs"]) >= {"prorl-one_phase@1", "prorl-no_reset@4", "plateau-one_phase@1", "opt-no_reset@1",
                                    "ref-no_reset@1", "adapter-no_reset@1"}  # fmt: skip
    frozen = {arm: (tmp_path / "runs" / f"{arm}-s0" / "trainer" / "frozen").is_dir()
              for arm in ("prorl", "opt", "ref", "adapter")}  # fmt: skip
    # opt's resets froze nothing (its adapter carried on); ref's kept the reference's copy, adapter's the old adapter
    # (which forwards each acts in: tests/test_reset_knobs.py)
    assert frozen == {"prorl": True, "opt": False, "ref": True, "adapter": True}
    task = prolonged.task_of(prolonged.parse_args(["--smoke", "--out", "x"]))
    held_out = list(make_arithmetic_dataset(4, seed=prolonged.VALIDATION_SEED, **task)["num_steps"])
    for run in runs:  # one counts line per validation, the counts behind the logged pass@1 and pass@4
        counts = prolonged.read_counts(tmp_path / "runs" / run / "counts.jsonl")
        evals = {row["prorl/global_step"]: row for row in prolonged.read_rows(tmp_path / "runs" / run / "rows.jsonl")
                 if "eval_pass@1" in row}  # fmt: skip
        assert sorted(counts) == sorted(evals) == [0, 1, 2, 3, 4]
        for step, line in counts.items():
            assert line["num_samples"] == 4 and line["num_steps"] == held_out
            assert evals[step]["eval_pass@1"] == pytest.approx(sum(line["correct"]) / 16)
            assert evals[step]["eval_pass@4"] == pytest.approx(sum(c > 0 for c in line["correct"]) / 4)

    # Counts as a GPU run with room writes them (the tiny smoke model solves nothing), with rows that match: the
    # report's per-problem tables are checked against counts read back by hand after the resume below.
    for run, start, end in (("one_phase-s0", [0, 1, 0, 2], [1, 0, 0, 4]), ("one_phase-s1", [0, 0, 0, 0], [0, 2, 0, 0]),
                            ("prorl-s0", [0, 1, 0, 2], [2, 1, 3, 4])):  # fmt: skip
        for step, correct in ((0, start), (4, end)):
            write_validation(tmp_path / "runs" / run, step, correct)

    # Cut one run short: no done.json, and its last phase's checkpoint gone, so it resumes from phase 2's.
    cut = tmp_path / "runs" / "prorl-s1"
    (cut / "done.json").unlink()
    shutil.rmtree(cut / "trainer" / "phase-3")
    others = {run: (tmp_path / "runs" / run / "done.json").stat().st_mtime_ns for run in runs - {cut.name}}
    result = prolonged.main(["--smoke", "--out", str(tmp_path), "--resume", "--launch", "subprocess", "--gpus", "1"])
    assert (cut / "done.json").is_file(), (tmp_path / "logs" / "prorl-s1.log").read_text()[-3000:]
    attempts = prolonged.read_jsonl(cut / "attempts.jsonl")
    assert len(attempts) == 2 and attempts[1]["resumed_from"].endswith("phase-2/checkpoint-1")
    assert json.loads((cut / "done.json").read_text())["attempts"] == 2
    for run, mtime in others.items():  # not re-run
        assert (tmp_path / "runs" / run / "done.json").stat().st_mtime_ns == mtime
        assert len(prolonged.read_jsonl(tmp_path / "runs" / run / "attempts.jsonl")) == 1
    evals = [row["prorl/global_step"] for row in prolonged.read_rows(cut / "rows.jsonl") if "eval_pass@1" in row]
    assert evals == [0, 1, 2, 3, 4]  # the re-run step's rows replace the first attempt's
    report = (tmp_path / "prolonged.md").read_text()
    assert "| (b) 4 phases + hard resets | 2 of 2 |" in report
    assert prolonged.read_counts(cut / "counts.jsonl")[4]["_attempt"] == 1  # the re-run validation's counts
    by_hand = {}
    for run in runs:
        counts = prolonged.read_counts(tmp_path / "runs" / run / "counts.jsonl")
        start, end = counts[0]["correct"], counts[4]["correct"]
        by_hand[run] = {"newly_solved": sum(s == 0 and e > 0 for s, e in zip(start, end)),
                        "newly_lost": sum(s > 0 and e == 0 for s, e in zip(start, end)),
                        "solved_start": sum(s > 0 for s in start), "solved_end": sum(e > 0 for e in end),
                        2: sum(c / 4 for c, ops in zip(end, held_out) if ops == 2) / held_out.count(2)}  # fmt: skip
    assert by_hand["one_phase-s0"]["newly_solved"] == by_hand["one_phase-s0"]["newly_lost"] == 1
    assert "| (a) one phase | 2 | 1.0 ± 0.0 | 0.5 ± 0.5 | 1.0 ± 1.0 | 1.5 ± 0.5 |" in report
    for entry in result["runs"]:
        expected = by_hand[f"{entry['arm']}-s{entry['seed']}"]
        assert all(entry["outcomes"][key] == expected[key] for key in prolonged.OUTCOMES), (entry, expected)
        assert entry["outcomes"]["by_operations"][2] == pytest.approx(expected[2])
    for arm in prolonged.ARMS:
        row = next(line for line in report.split("## Final pass@1 by number")[1].splitlines()
                   if line.startswith(f"| {prolonged.ARMS[arm]} | 2 |"))  # fmt: skip
        assert row.split(" | ")[3] == prolonged.pct([by_hand[f"{arm}-s{seed}"][2] for seed in (0, 1)])
    solved = result["pairs"]["prorl-one_phase@newly_solved"]["per_seed"]
    assert solved == [by_hand[f"prorl-s{s}"]["newly_solved"] - by_hand[f"one_phase-s{s}"]["newly_solved"]
                      for s in (0, 1)]  # fmt: skip
    assert "- (b) - (a) newly solved: " in report and "- (d) - (a) newly lost: " in report


def assert_replicates_reads_the_study(study):
    """benchmarks/replicates.py on a real study: on CPU every arm of a seed is one run through phase 0 (step 1 in the
    smoke), and a copy of the study with one logged loss changed differs at that step and nowhere before."""
    replicates = load_benchmark("replicates")
    within = replicates.main([f"cpu={study}", "--through", "1"]).split("## Arms of one seed")[1]
    pairs = [line for line in within.splitlines() if line.startswith("| cpu |")]
    assert len(pairs) == 2 * math.comb(len(prolonged.ARMS), 2)
    assert all(line.endswith("| 1 | none | same / same |") for line in pairs)  # rows, then validation counts
    copy = study / "copy"
    shutil.copytree(study / "runs", copy / "runs")
    rows = (copy / "runs" / "prorl-s0" / "rows.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(rows) if '"loss"' in line and json.loads(line)["prorl/global_step"] == 3)
    changed = json.loads(rows[at])
    changed["loss"] += 1e-12
    rows[at] = json.dumps(changed)
    (copy / "runs" / "prorl-s0" / "rows.jsonl").write_text("\n".join(rows) + "\n")
    across = replicates.main([f"a={study}", f"b={copy}", "--through", "4", "--export", str(copy / "rows.csv.gz")])
    lines = [line for line in across.split("## Arms of one seed")[0].splitlines() if "| a vs b |" in line]
    assert len(lines) == 2 * len(prolonged.ARMS)
    assert [line.split(" | ")[3] for line in lines if line.startswith("| prorl-s0 |")] == ["3"]
    assert all(line.endswith("| same / same |") for line in lines)  # the changed loss left the counts alone
    assert all(line.split(" | ")[3] == "none" for line in lines if not line.startswith("| prorl-s0 |"))
    assert replicates.main(["--rows", str(copy / "rows.csv.gz"), "--through", "4"]) == across  # the export reads back
    shutil.rmtree(copy)


def write_validation(run_dir, step, correct):
    """Appends a counts line and the matching validation row for `step` (a later line replaces an earlier one)."""
    line = {**prolonged.read_counts(run_dir / "counts.jsonl")[step], "correct": correct}
    with (run_dir / "counts.jsonl").open("a") as file:
        file.write(json.dumps(line) + "\n")
    row = next(row for row in prolonged.read_rows(run_dir / "rows.jsonl")
               if "eval_pass@1" in row and row["prorl/global_step"] == step)  # fmt: skip
    row.update({"eval_pass@1": sum(correct) / 16, "eval_pass@4": sum(c > 0 for c in correct) / 4})
    with (run_dir / "rows.jsonl").open("a") as file:
        file.write(json.dumps(row) + "\n")


def test_pilot_runs_arm_a_per_grid_point_with_one_warm_start_per_task(tmp_path):
    """`--pilot`: one run of arm (a) per combination of `--pilot-grid`; the two learning rates share a task and so
    its warm start; `pilot.md` has a row with a pass@1 curve and a plateau verdict per setting."""
    grid = "task_steps=1-2;learning_rate=1e-4,3e-5"
    result = prolonged.main(["--smoke", "--out", str(tmp_path), "--pilot", "--pilot-grid", grid, "--steps", "4"])
    assert set(result["curves"]) == {"task_steps-1-2_learning_rate-1e-4", "task_steps-1-2_learning_rate-3e-5"}
    assert [p.parent.name for p in (tmp_path / "pilot").glob("*/warm_start")] == ["task-1-2-max20-acc0.3"]
    rows = [line for line in (tmp_path / "pilot.md").read_text().splitlines() if line.startswith("| task_steps")]
    assert len(rows) == 2 and all("| 0:" in row and ("| yes |" in row or "| no |" in row) for row in rows)
    assert "| start pass@1 | start pass@n |" in (tmp_path / "pilot.md").read_text()  # the warm start's room (issue 38)
    assert all(len(row.split(" | ")) == 10 for row in rows)
    assert (tmp_path / "pilot.png").is_file()
    stopped = tmp_path / "pilot" / "task_steps-1-2_learning_rate-3e-5"  # as a NaN stop leaves it: kept on --resume
    (stopped / "done.json").unlink()
    (stopped / "stopped.json").write_text(json.dumps({"step": 3}))
    prolonged.main(["--smoke", "--out", str(tmp_path), "--pilot", "--pilot-grid", grid, "--steps", "4", "--resume"])
    assert len(prolonged.read_jsonl(stopped / "attempts.jsonl")) == 1 and not (stopped / "done.json").exists()
    assert "learning_rate-3e-5 (stopped before step 3: NaN/inf) |" in (tmp_path / "pilot.md").read_text()


def test_arms_split_over_calls_share_one_warm_start_and_gather_into_one_report(tmp_path, capsys):
    """Two calls, each its own arms (the first with (b) on a device of its own, `--solo-arms`), the second reusing
    the first's warm start (`--warm-start`); their runs gathered into one folder make one report over all arms. A run
    stopped by a non-finite gradient is reported as stopped, not as finished."""
    first, second, gathered = tmp_path / "first", tmp_path / "second", tmp_path / "gathered"
    common = ["--smoke", "--seeds", "0", "--launch", "subprocess", "--gpus", "1", "--per-gpu", "2"]
    prolonged.main([*common, "--out", str(first), "--arms", "one_phase,prorl", "--solo-arms", "prorl"])
    printed = capsys.readouterr().out
    assert printed.index("prorl-s0 ended") < printed.index("one_phase-s0 started"), printed  # alone on its device
    warm = first / "warm_start"
    recorded = json.loads((warm / "warm_start.json").read_text())["sha256"]
    assert recorded == prolonged.weights_sha256(warm)
    with pytest.raises(SystemExit, match="not --warm-start-sha256 0{64}: it is not the warm start"):
        prolonged.main([*common, "--out", str(tmp_path / "other"), "--arms", "no_reset", "--warm-start", str(warm),
                        "--warm-start-sha256", "0" * 64])  # fmt: skip
    assert not (tmp_path / "other" / "runs").exists()
    inline = [*common[:3], "--launch", "inline"]  # the second call in-process: worker processes are tested above
    prolonged.main([*inline, "--out", str(second), "--arms", "no_reset,plateau", "--warm-start", str(warm),
                    "--warm-start-sha256", recorded])  # fmt: skip
    assert (second / "warm_start" / "model.safetensors").read_bytes() == (warm / "model.safetensors").read_bytes()
    assert "[prolonged] warm_start" not in capsys.readouterr().out  # copied, not trained again
    stopped = second / "runs" / "plateau-s0"
    device = json.loads((stopped / "done.json").read_text())["device"]
    (stopped / "done.json").unlink()
    (stopped / "stopped.json").write_text(json.dumps({"step": 3, "reason": "non-finite gradient", "device": device}))
    packed = tmp_path / "packed"  # the first call's record as the repository keeps it
    record = gather_tool.main(["pack", str(first), str(packed)])
    assert record["finished"] == ["one_phase-s0", "prorl-s0"] and record["warm_start_sha256"] == recorded
    assert not (packed / "runs").exists() and (packed / "runs.tar.gz").is_file()
    result = gather_tool.main(["gather", "--out", str(gathered), "--warm-start", str(warm), str(packed), str(second)])
    assert result["sources"] == {"no_reset-s0": str(second), "one_phase-s0": str(packed),
                                 "plateau-s0": str(second), "prorl-s0": str(packed)}  # fmt: skip
    result = result["report"]
    report = (gathered / "prolonged.md").read_text()
    for arm in ("one_phase", "prorl", "no_reset"):
        assert f"| {prolonged.ARMS[arm]} | 1 of 1 (seeds 0) |" in report  # a gather names the seeds it holds
    assert "| (d) one phase + resets on a plateau | 0 of 1 (1 stopped: non-finite gradient) (seeds 0) |" in report
    assert report.startswith("# Prolonged RL with hard resets: 4 arms x 1 seeds")
    assert "(stopped before step 3: non-finite gradient)" in report
    assert "Stopped by a non-finite (NaN/inf) gradient: 1 of 4 runs; continued from a checkpoint" in report
    assert {"prorl-one_phase@1", "prorl-no_reset@1"} <= set(result["pairs"])
    runs = prolonged.load_runs(gathered)  # each arm counts the runs gathered for it, not the union of all seeds
    runs += [{**run, "seed": 1} for run in runs if run["arm"] == "no_reset"]
    assert prolonged.runs_planned(None, runs, gathered=True)["no_reset"] == 2
    assert prolonged.runs_planned(None, runs, gathered=True)["one_phase"] == 1
    assert_gather_refuses_what_is_not_one_study(tmp_path, warm, packed, second, gathered)


def assert_gather_refuses_what_is_not_one_study(tmp_path, warm, packed, second, gathered):
    """prolonged_gather.py refuses, before writing anything, runs that are not one study's: other settings, one run
    twice, another warm start, an --out it did not write; a second gather into its own --out rewrites it."""
    def refused(sources, match, out=None, warm_start=warm):
        target = out or tmp_path / "refused"
        with pytest.raises(SystemExit, match=match):
            gather_tool.main(["gather", "--out", str(target), "--warm-start", str(warm_start), *map(str, sources)])
        assert out or not target.exists()

    other = tmp_path / "other_lr"
    shutil.copytree(packed, other)
    settings = json.loads((other / "settings.json").read_text())
    (other / "settings.json").write_text(json.dumps({**settings, "learning_rate": 3e-5, "gpus": 4}))
    refused([packed, other], r"ran other settings than .*\(learning_rate: 0.0001 in .*, 3e-05 here\)")
    older = tmp_path / "older"  # a call from before an option existed: its default, the same study
    shutil.copytree(packed, older)
    (older / "settings.json").write_text(json.dumps({k: v for k, v in settings.items() if k != "full_determinism"}))
    assert gather_tool.study_settings(older) == gather_tool.study_settings(packed)
    refused([packed, older], "one_phase-s0 is in both")
    padded = tmp_path / "padded"  # a hand-made "-s00" would be read as seed 0 a second time
    shutil.copytree(second, padded, ignore=shutil.ignore_patterns("trainer", "study.lock", "mps"))
    (padded / "runs" / "no_reset-s0").rename(padded / "runs" / "no_reset-s00")
    refused([padded], r"no_reset-s00 is not a run folder prolonged.py names")
    unpinned = tmp_path / "unpinned"
    shutil.copytree(packed, unpinned)
    (unpinned / "settings.json").write_text(json.dumps({**settings, "warm_start_sha256": "0" * 64}))
    refused([packed, unpinned], "began from warm start 0{64}, .* from [0-9a-f]{64}: its runs are another study")
    refused([unpinned], "has weights sha256 [0-9a-f]{64}, and the runs of .* began from 0{64}")
    (unpinned / "settings.json").write_text(json.dumps(settings))
    (unpinned / "warm_start.json").unlink()
    refused([unpinned], "records no warm start")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    refused([packed], "holds files that no gather wrote", out=tmp_path / "foreign")
    refused([packed], "lies inside --out", out=gathered, warm_start=gathered / "warm_start")
    assert (gathered / "warm_start" / "warm_start.json").is_file()
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in ("settings.json", "warm_start.json"):
        shutil.copy(packed / name, hostile / name)
    with tarfile.open(hostile / "runs.tar.gz", "w:gz") as tar:
        tar.add(packed / "settings.json", arcname="../escape.json")
    refused([hostile], "holds '../escape.json', not a run file")
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "gathered.json").write_text(json.dumps({"runs": ["prorl-s0", "../../keep"]}))
    refused([packed], "lists .*, not all run folders' names", out=forged)
    (gathered / "runs" / "one_phase-s0" / "rows.jsonl").write_text("")  # a second gather rewrites what it wrote
    again = gather_tool.main(["gather", "--out", str(gathered), "--warm-start", str(warm), str(packed), str(second)])
    assert again["runs"] == ["no_reset-s0", "one_phase-s0", "plateau-s0", "prorl-s0"]
    with tarfile.open(packed / "runs.tar.gz") as tar:
        packed_rows = tar.extractfile("runs/one_phase-s0/rows.jsonl").read()
    assert (gathered / "runs" / "one_phase-s0" / "rows.jsonl").read_bytes() == packed_rows != b""


def test_the_warm_start_is_made_again_bit_for_bit(tmp_path):
    """Runs continued on a later machine make their warm start there again (74 MB does not travel): the same
    settings must give the same weights. Two warm starts of round 4's task made on one H200 without HF's
    `full_determinism` differed (2026-11-28); with it they matched. Here on CPU, at the smoke's sizes."""
    import torch

    made, before = [], torch.are_deterministic_algorithms_enabled()
    for name in ("a", "b"):
        args = prolonged.parse_args(["--smoke", "--out", str(tmp_path / name)])
        args.warm_dir = str(tmp_path / name / "warm_start")
        prolonged.run_warm_start(args)
        made.append(json.loads((tmp_path / name / "warm_start" / "warm_start.json").read_text())["sha256"])
    assert made[0] == made[1] == prolonged.weights_sha256(tmp_path / "a" / "warm_start")
    # full_determinism is process-wide: made in this process, the warm start hands the process back as it found it
    assert torch.are_deterministic_algorithms_enabled() == before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_a_bfloat16_copy_of_the_warm_start_is_what_gpu_runs_read_and_cpu_runs_refuse(tmp_path, monkeypatch):
    """A float32 warm start of round 4 (74 MB) does not fit a 64 MiB carry; its bfloat16 copy does. GPU runs load
    the warm start with `dtype=bfloat16`, so the copy must hold exactly those numbers, pass `--warm-start-sha256` of
    the original, and be refused where runs read float32 (CPU) or when damaged."""
    import torch
    from transformers import AutoModelForCausalLM

    args = prolonged.parse_args(["--smoke", "--out", str(tmp_path / "a")])
    warm = tmp_path / "a" / "warm_start"
    args.warm_dir = str(warm)
    prolonged.run_warm_start(args)
    original = json.loads((warm / "warm_start.json").read_text())["sha256"]
    info = prolonged.export_bf16_warm_start(warm, tmp_path / "carry")
    copy = tmp_path / "carry" / "warm_start"
    assert info["made_from_sha256"] == original != info["sha256"] == prolonged.weights_sha256(copy)
    read = {name: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
            for name, folder in (("original", warm), ("copy", copy))}  # fmt: skip
    assert read["original"].keys() == read["copy"].keys()
    assert all(torch.equal(read["original"][k], read["copy"][k]) for k in read["original"])
    args.warm_start_sha256 = original
    with pytest.raises(SystemExit, match="is a bfloat16 copy, and runs on this device read the warm start in float32"):
        prolonged.check_warm_start_sha256(args, copy)
    monkeypatch.setattr(prolonged, "device_kwargs", lambda args: {"bf16": True})
    prolonged.check_warm_start_sha256(args, copy)  # accepted where runs read bfloat16
    args.warm_start_sha256 = "0" * 64
    with pytest.raises(SystemExit, match="not --warm-start-sha256"):
        prolonged.check_warm_start_sha256(args, copy)
    args.warm_start_sha256 = original
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match="not --warm-start-sha256"):
        prolonged.check_warm_start_sha256(args, copy)
    with pytest.raises(SystemExit, match="exists"):
        prolonged.export_bf16_warm_start(warm, tmp_path / "carry")


def test_export_without_a_finished_warm_start_is_refused_not_skipped(tmp_path):
    """`--export-warm-start` when the warm start did not get made (here: its time limit already past) says so and exits
    non-zero; it does not end as a success that wrote nothing."""
    with pytest.raises(SystemExit, match="--export-warm-start: no warm start in .* to copy"):
        prolonged.main(["--smoke", "--out", str(tmp_path / "o"), "--launch", "inline", "--time-limit=-1",
                        "--export-warm-start", str(tmp_path / "carry")])  # fmt: skip
    assert not (tmp_path / "carry").exists()


def test_a_pilot_refuses_a_warm_start_sha256_it_could_not_check(tmp_path, capsys):
    """A pilot trains one warm start per task, so one recorded sha256 would be accepted and never checked."""
    with pytest.raises(SystemExit):
        prolonged.parse_args(["--out", str(tmp_path), "--pilot", "--warm-start-sha256", "0" * 64])
    assert "--pilot trains one per task" in capsys.readouterr().err


def test_a_completion_cap_that_cuts_reference_solutions_is_refused_before_any_run(tmp_path):
    """The round-4 pilot's 3-5 operation task on numbers to 99 ran at the default cap of 48 tokens, which cuts about a
    quarter of its reference solutions: its "never solved" counted the cap. Such a cap is refused, for a study and
    for every pilot grid point, before a warm start is trained; a cap that fits runs."""
    longest, lengths = prolonged.longest_solution_tokens(prolonged.parse_args(
        ["--out", str(tmp_path), "--task-steps", "3-5", "--task-max-value", "99"]))  # fmt: skip
    assert 48 < longest < 80 and sum(lengths.values()) == 4000
    assert max(prolonged.longest_solution_tokens(prolonged.parse_args(["--out", str(tmp_path)]))[1]) <= 48  # round 3
    with pytest.raises(SystemExit, match=r"--max-completion-length 48 cuts the reference solution of 2\d% .* 80 or more"):
        prolonged.main(["--out", str(tmp_path / "study"), "--task-steps", "3-5", "--task-max-value", "99"])
    assert not (tmp_path / "study" / "settings.json").exists()
    with pytest.raises(SystemExit, match="--task-steps 4-6 --task-max-value 99"):
        prolonged.main(["--out", str(tmp_path / "pilot"), "--pilot", "--task-max-value", "99", "--max-completion-length",
                        "64", "--pilot-grid", "task_steps=3-5,4-6"])  # fmt: skip
    assert not (tmp_path / "pilot" / "pilot").exists()
    prolonged.check_completion_cap(prolonged.parse_args(
        ["--out", str(tmp_path), "--task-steps", "3-5", "--task-max-value", "99", "--max-completion-length", "80"]))


def test_mps_is_refused_before_any_work_where_it_cannot_run(tmp_path, monkeypatch, capsys):
    """`--mps` needs worker processes and NVIDIA's MPS control program: without either it is refused with what to do,
    before the output folder is made, instead of being accepted and quietly running without MPS."""
    with pytest.raises(SystemExit):
        prolonged.parse_args(["--out", str(tmp_path / "o"), "--smoke", "--mps"])
    assert "--launch inline (the --smoke default) starts none" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="--mps: nvidia-cuda-mps-control is not on PATH"):
        prolonged.main(["--out", str(tmp_path / "o"), "--smoke", "--launch", "subprocess", "--mps"])
    assert not (tmp_path / "o").exists()


def test_the_mps_daemon_is_the_studys_own_and_quit_after_its_workers(tmp_path, monkeypatch):
    """The CPU machine has no NVIDIA driver, so a stand-in control program records how it is called: one daemon per
    call of the study (`-d`), its pipe and log folders inside OUT, serving every batch of workers (the warm start's,
    then the runs'), and told `quit` once at the end. Workers never start outside it."""
    calls = tmp_path / "calls.txt"
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    control.write_text('#!/bin/sh\n{ echo "$* | $CUDA_MPS_PIPE_DIRECTORY | $CUDA_MPS_LOG_DIRECTORY"; '
                       '[ "$1" = "-d" ] || cat; } >> "$MPS_CALLS"\n')  # fmt: skip
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{control.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("MPS_CALLS", str(calls))
    for renumbered in ("1", "0,2"):  # the daemon would serve these as 0 (, 1): the workers' "1" / "2" would not exist
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", renumbered)
        with pytest.raises(SystemExit, match=f"CUDA_VISIBLE_DEVICES={renumbered}: the MPS daemon renumbers"):
            prolonged.main(["--out", str(tmp_path / "refused"), "--launch", "subprocess", "--mps"])
        assert not (tmp_path / "refused").exists() and not calls.exists()
    for kept in ("0,1", "GPU-3c93a829"):  # the same numbers after renumbering, or UUIDs
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", kept)
        assert prolonged.mps_control() == str(control)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    out = tmp_path / "o"
    (out / "logs").mkdir(parents=True)
    args = prolonged.parse_args(["--out", str(out), "--launch", "subprocess", "--mps", "--gpus", "1"])
    job = ("report", ["--out", str(out / "empty"), "--report-only"])
    with pytest.raises(RuntimeError, match="would run without MPS"):
        prolonged.run_jobs(args, [job], deadline=math.inf)
    with prolonged.study_mps(args, out):
        prolonged.run_jobs(args, [job], deadline=math.inf)
        prolonged.run_jobs(args, [job], deadline=math.inf)
    mps = (out / "mps").resolve()
    assert calls.read_text().splitlines() == [f"-d | {mps}/pipe | {mps}/log", f" | {mps}/pipe | {mps}/log", "quit"]
    log = (out / "logs" / "report.log").read_text()
    assert log.count("No warm start in") == 2  # both batches ran, between the start and the quit
    with prolonged.study_mps(prolonged.parse_args(["--out", str(out), "--mps", "--report-only", "--launch",
                                                   "subprocess"]), out):  # fmt: skip
        pass  # a report needs no workers: no daemon
    assert len(calls.read_text().splitlines()) == 3


def test_final_is_the_last_validation_and_best_leaves_out_the_warm_starts():
    """Every arm starts at the warm start's validation (step 0): a sharpening arm's pass@64 only falls from there, so
    a best counting step 0 was the warm start's score for every arm (the first round-4 reports). A run whose
    validations do not span step 0 to the last step is refused: "final" and the outcomes read them by position."""
    evals = [{"prorl/global_step": step, "eval_pass@1": p1, "eval_pass@64": p64}
             for step, p1, p64 in ((0, 0.02, 0.36), (375, 0.03, 0.30), (750, 0.05, 0.25), (1125, 0.04, 0.20))]  # fmt: skip
    run = {"arm": "prorl", "seed": 3, "evals": evals}
    final, best = prolonged.final_and_best(run, [1, 64], 1125)
    assert final == {1: 0.04, 64: 0.20} and best == {1: 0.05, 64: 0.30}
    for cut in (evals[1:], evals[:-1]):
        with pytest.raises(SystemExit, match=r"runs/prorl-s3: validations at steps \[.*a line of rows.jsonl is"):
            prolonged.final_and_best({**run, "evals": cut}, [1, 64], 1125)
    broken = [*evals[:1], {**evals[1], "eval_pass@64": float("nan")}, *evals[2:]]  # max() would keep or drop it
    with pytest.raises(SystemExit, match="runs/prorl-s3: pass@64 of the validation at step 375 is NaN"):
        prolonged.final_and_best({**run, "evals": broken}, [1, 64], 1125)


def test_the_plateau_criterion_reads_pooled_pass_at_1_over_the_last_third(tmp_path):
    """Round 4's pre-set criterion, against hand-computed values: per seed, pass@1 at the end minus at the first
    validation from step 1,000 of 1,500 (here 1,125); plateaued when the mean is under 1 point and its 95% CI holds 0.
    A steady rise is not a plateau, nor is a single seed (no interval)."""
    args = prolonged.parse_args(["--out", str(tmp_path), "--steps", "1500", "--eval-steps", "375"])

    def run(at_1125, at_1500, reward_before=0.1, reward_last=0.1):
        evals = [{"prorl/global_step": step, "eval_pass@1": value}
                 for step, value in ((0, 0.02), (375, 0.03), (750, 0.04), (1125, at_1125), (1500, at_1500))]  # fmt: skip
        rewards = [{"prorl/global_step": step, "reward": reward_before if step <= 1250 else reward_last}
                   for step in range(1001, 1501)]  # fmt: skip
        return {"evals": evals, "rows": rewards + [{"prorl/global_step": 1000, "reward": 9.0}]}

    flat = [run(0.045, 0.050, 0.1, 0.2), run(0.050, 0.048), run(0.040, 0.046)]  # gains +0.5, -0.2, +0.6 points
    gains = prolonged.last_third_gains(args, flat)
    assert gains["pass@1"] == pytest.approx([0.005, -0.002, 0.006])
    assert gains["reward"] == pytest.approx([0.1, 0.0, 0.0])  # steps 1,001-1,250 against 1,251-1,500; 1,000 is out
    lines = prolonged.last_third_lines(args, flat)
    assert lines[0].startswith("Over the last third (from the validation at step 1125, the first at or after step 1000")
    # mean 0.3 pts, s.e. sqrt(19e-6 / 3) = 0.2517 pts, t(2) 4.303: [-0.78, +1.38]
    assert "pass@1 +0.30 pts, 95% CI [-0.78, +1.38] (n=3)" in lines[0] and lines[0].endswith("**yes**.")
    rising = [run(0.040, 0.060), run(0.045, 0.062), run(0.050, 0.071)]
    assert prolonged.last_third_lines(args, rising)[0].endswith("**no**.")  # +1.9 pts, CI above 0
    assert prolonged.last_third_lines(args, flat[:1])[0].endswith("**no**.")
    report = prolonged.plateau_lines(args, [{**run, "seed": seed} for seed, run in enumerate(flat)])
    assert "Gain over the last half" in report[0] and any(line.startswith("Over the last third") for line in report)


def test_step_split_times_every_training_step_of_every_phase_into_the_report(tmp_path):
    """`--step-split` writes each training step's parts to the run's split.jsonl as it goes (so a run stopped at its
    time limit keeps them) and the report gives each arm's medians: (b) has one step in each of its 4 phases."""
    prolonged.main(["--smoke", "--out", str(tmp_path), "--arms", "one_phase,prorl", "--seeds", "0", "--step-split"])
    from _step_split import PARTS  # on sys.path once load_benchmark has run

    parts = (*PARTS, "other")
    for arm, calls in (("one_phase", [0, 0, 0, 0]), ("prorl", [0, 1, 2, 3])):
        rows = prolonged.read_jsonl(tmp_path / "runs" / f"{arm}-s0" / "split.jsonl")
        assert [row["call"] for row in rows] == calls, arm
        for row in rows:
            assert row["tokens"] > 0 and row["generation"] > 0 and row["backward"] > 0 and row["optimizer"] > 0
            assert sum(row[part] for part in parts) == pytest.approx(row["seconds"], abs=1e-3)
    report = (tmp_path / "prolonged.md").read_text()
    assert "## Where a training step goes" in report
    assert "| (a) one phase | 4 |" in report and "| (b) 4 phases + hard resets | 4 |" in report


def test_a_second_call_on_the_same_out_is_refused_while_any_process_of_the_first_lives(tmp_path, monkeypatch):
    """Two calls on one OUT would train the same runs twice into the same folders. A call holds OUT/study.lock;
    its workers inherit the lock, so a call whose parent was killed still holds it through them. A report only
    reads and needs no lock."""
    out = tmp_path / "o"
    (out / "logs").mkdir(parents=True)
    args = prolonged.parse_args(["--out", str(out), "--launch", "subprocess", "--gpus", "1"])
    with prolonged.study_lock(args, out):
        with pytest.raises(SystemExit, match=rf"{out} is in use by another prolonged.py call \(pid {os.getpid()}"):
            prolonged.main(["--out", str(out), "--smoke"])
        assert not (out / "settings.json").exists()  # refused before anything was written
        with pytest.raises(SystemExit, match="No warm start in"):  # a report goes past the lock (and finds no runs)
            prolonged.main(["--out", str(out), "--report-only"])
        python = sys.executable
        stand_in = tmp_path / "bin" / "python"  # lists the files a worker has open
        stand_in.parent.mkdir()
        stand_in.write_text('#!/bin/sh\nls -l /proc/$$/fd > "$0.fds"\n')
        stand_in.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(stand_in))
        prolonged.run_jobs(args, [("worker", [])], deadline=math.inf)
        monkeypatch.undo()
        assert str((out / "study.lock").resolve()) in Path(f"{stand_in}.fds").read_text()
        worker = subprocess.Popen([python, "-c", "import time; time.sleep(60)"], pass_fds=(args.lock_fd,))
    try:
        with pytest.raises(SystemExit, match="is in use"):  # the parent let go; its worker still holds the lock
            prolonged.main(["--out", str(out), "--smoke"])
    finally:
        worker.kill()
        worker.wait()
    with prolonged.study_lock(args, out):  # free again once the worker is gone
        assert (out / "study.lock").read_text().startswith(f"pid {os.getpid()}, started ")


def test_full_determinism_reaches_the_trainer_and_the_process_gets_its_state_back(tmp_path, monkeypatch):
    """`--full-determinism on` is TrainingArguments.full_determinism in every worker's config (the GPU probe of where
    runs part); the smoke workers run in this process, so torch's and the environment's switches come back after."""
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "0")
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        prolonged.main(["--smoke", "--out", str(tmp_path), "--arms", "one_phase", "--seeds", "0",
                        "--full-determinism", "on"])  # fmt: skip
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(before)
    saved = sorted((tmp_path / "runs" / "one_phase-s0" / "trainer").rglob("training_args.bin"))
    assert saved and all(torch.load(path, weights_only=False).full_determinism for path in saved)
    assert json.loads((tmp_path / "settings.json").read_text())["full_determinism"] == "on"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and os.environ["CUDA_LAUNCH_BLOCKING"] == "0"
