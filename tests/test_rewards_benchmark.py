"""The reward throughput benchmark runs end to end in --smoke mode (so it cannot rot) and prints its three tables:
throughput, worst cases of the time bound, and the MATH-500 differential (10 golds in smoke mode)."""

from __future__ import annotations

import rewards
from _benchmarks import load_benchmark


def test_rewards_throughput_smoke(shared_data, tmp_path):
    module = load_benchmark("rewards_throughput")
    output = tmp_path / "table.md"
    table = module.main(["--smoke", "--data", str(shared_data), "--output", str(output)])
    assert output.read_text().strip() == table.strip()
    assert "CPU: " in table and "smoke run" in table
    throughput, worst, differential = table.split("\n## ")
    rows = [line for line in throughput.splitlines() if line.startswith("| ") and not line.startswith("| reward")]
    labels = [row.split("|")[1].strip() for row in rows]
    assert sorted(label.split(" ")[0] for label in labels[:-1]) == sorted(rewards.BUILTIN_REWARDS)
    assert "MATH-500" in labels[-1]
    # on GSM8K the constructed ground truth is reproduced exactly by both correctness rewards
    for row in rows[:-1]:
        cells = [cell.strip() for cell in row.split("|")]
        if cells[1].startswith(("boxed_answer", "math_equivalence")):
            assert cells[4] == "100.0%"
    # the worst-case table holds the bound, and the smoke differential (10 golds) gives no false credit
    worst_rows = [line for line in worst.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert worst_rows and all(line.rstrip(" |").endswith("yes") for line in worst_rows)
    assert "right after a timeout" in worst_rows[0] and worst_rows[0].split("|")[5].strip() == "1"  # not None
    total = next(line for line in differential.splitlines() if line.startswith("| **all**"))
    assert total.split("|")[4].strip() == "0"  # math_equivalence credits no wrong answer
