"""The reward throughput benchmark runs end to end in --smoke mode (so it cannot rot) and prints one complete table."""

from __future__ import annotations

import rewards
from _benchmarks import load_benchmark


def test_rewards_throughput_smoke(shared_data, tmp_path):
    module = load_benchmark("rewards_throughput")
    output = tmp_path / "table.md"
    table = module.main(["--smoke", "--data", str(shared_data), "--output", str(output)])
    assert output.read_text().strip() == table.strip()
    assert "CPU: " in table and "smoke run" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| reward")]
    labels = [row.split("|")[1].strip() for row in rows]
    assert sorted(label.split(" ")[0] for label in labels[:-1]) == sorted(rewards.BUILTIN_REWARDS)
    assert "MATH-500" in labels[-1]
    # on GSM8K the constructed ground truth is reproduced exactly by both correctness rewards
    for row in rows[:-1]:
        cells = [cell.strip() for cell in row.split("|")]
        if cells[1].startswith(("boxed_answer", "math_equivalence")):
            assert cells[4] == "100.0%"
