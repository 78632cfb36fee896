"""`benchmarks/qlora.py --smoke`: every base (bf16, bitsandbytes 4-bit and 8-bit on the CPU backend, and the bf16 base
with merge resets) runs its two phases with a hard reset in between, and the table renders. About 25 s."""

import json

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("bitsandbytes")


def test_smoke_runs_every_base_and_renders_the_table(tmp_path, capsys):
    bench = load_benchmark("qlora")
    result = bench.main(["--smoke", "--json", str(tmp_path / "q.json"), "--out", str(tmp_path / "q.md")])
    rows = {row["base"]: row for row in result["results"]}
    assert list(rows) == ["bf16", "4bit", "8bit", "merge"]
    for base, row in rows.items():
        assert "error" not in row, row
        assert len(row["step_seconds"]) == 4 and row["mean_completion_length"] == 6  # 2 phases x 2 steps, at the cap
        [reset] = row["resets"]
        assert reset["seconds"] > 0 and "prorl/reset_logp_change" in reset
        if base == "merge":
            assert row["lora_reset_mode"] == "merge" and reset["frozen_rank_total"] == 0
        else:  # frozen: nothing changed, the delta kept as 4 layers x rank 4
            assert row["lora_reset_mode"] == "frozen" and reset["frozen_rank_total"] == 16
            assert reset["prorl/reset_logp_change"] == 0 and reset["max_abs_logits_change"] == 0
    table = (tmp_path / "q.md").read_text()
    assert table in capsys.readouterr().out
    assert "| 4bit | frozen |" in table and "| 8bit | frozen |" in table and "| merge | merge |" in table
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["meta"]["device"] == "CPU (smoke)" and "bitsandbytes" in saved["meta"]["versions"]
    assert [row["base"] for row in saved["results"]] == ["bf16", "4bit", "8bit", "merge"]
