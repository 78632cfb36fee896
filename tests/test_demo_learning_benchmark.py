"""benchmarks/learning.py runs end to end in its CPU smoke mode: warm start, (a) 3 phases with resets, (b) one phase,
validation curves for both, one markdown table."""

import json

from _benchmarks import load_benchmark


def test_learning_benchmark_smoke(tmp_path, capsys):
    benchmark = load_benchmark("learning")
    result = benchmark.main(["--smoke", "--out", str(tmp_path)])
    table = (tmp_path / "learning.md").read_text().strip().splitlines()
    assert capsys.readouterr().out.strip().splitlines()[-3:] == table
    assert len(table) == 3 and table[0].startswith("| CPU") and "(smoke)" in table[0]
    steps_a, _ = result["curves"]["a"]
    steps_b, _ = result["curves"]["b"]
    assert steps_a == steps_b == [0.0, 1.0, 2.0, 3.0], "both runs validated at start and every step, equal length"
    history = json.loads((tmp_path / "a_prorl_resets" / "prorl_log_history.json").read_text())
    assert max(entry.get("prorl/resets", 0) for entry in history) == 2
    assert {entry.get("prorl/phase") for entry in history if "reward" in entry} == {0, 1, 2}
    assert (tmp_path / "validation.png").stat().st_size > 1000
    assert json.loads((tmp_path / "learning.json").read_text())["a_final_pass@1"] == result["a_final_pass@1"]


def test_table_compares_generation_paths_within_noise():
    """`--compare-rollout-engine`: one row per generation path and, per run, whether the engine's result is within two
    standard errors of the first path's (200 problems: 2 s.e. is ~10 points at 60 %)."""
    benchmark = load_benchmark("learning")

    def run(generation, a, b):
        return {"generation": generation, "warm_start_pass@1": 0.25, "a_final_pass@1": a, "b_final_pass@1": b,
                "seconds": {"warm_start": 60.0, "a": 100.0 if generation == "generate" else 60.0, "b": 90.0}}  # fmt: skip

    runs = [run("generate", 0.60, 0.57), run("rollout_engine", 0.62, 0.40)]
    result = {"device": "GPU", "smoke": False, "parameters": 19e6, "steps": 240, "phases": 3,
              "validation_problems": 200, **runs[0], "runs": runs}  # fmt: skip
    lines = benchmark.render_table(result).splitlines()
    assert lines[2].endswith("hard resets, generate | 25.0% | 60.0% (+35.0 pts) | 57.0% (+32.0 pts) "
                             "| not significantly: +3.0 pts (2 s.e. 9.8) | 60 / 100 / 90 |")  # fmt: skip
    assert "hard resets, rollout_engine |" in lines[3]
    assert lines[-2] == "(a) rollout_engine vs generate: +2.0 pts (2 s.e. 9.8, within noise); wall 100 -> 60 s"
    assert lines[-1].startswith("(b) rollout_engine vs generate: -17.0 pts") and "NOT within noise" in lines[-1]


def test_reset_comparison_smoke_brackets_every_reset(tmp_path):
    """`--lora-rank` (issue 27): frozen resets, merging resets and one phase from one warm start, each reset bracketed by
    two validations with one sampling seed; a frozen reset leaves pass@1 exactly as it was."""
    benchmark = load_benchmark("learning")
    result = benchmark.main(["--smoke", "--out", str(tmp_path), "--lora-rank", "4"])
    arms = result["arms"]
    assert list(arms) == ["resets", "merge", "no_reset"]
    assert [step for step, _, _ in arms["resets"]["around_resets"]] == [1, 2] and not arms["no_reset"]["around_resets"]
    assert all(before == after for _, before, after in arms["resets"]["around_resets"])
    table = (tmp_path / "learning.md").read_text().splitlines()
    assert "LoRA r4" in table[0] and table[2].startswith("| (a) 3 phases + hard resets (frozen factors)")
    assert "step 1:" in table[2] and "step 1:" in table[3] and "| - |" in table[4]  # one phase: no reset
