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
