"""`ProRLTrainer.request_stop` under 2-process DDP (gloo, CPU): a stop asked on one rank only (a signal that reached
one process) stops every rank after the same step, with one checkpoint both name (~30 s)."""

import json
from pathlib import Path

from test_ddp import run_two_processes

WORKER = Path(__file__).resolve().parent / "_ddp_stop_worker.py"


def test_a_stop_on_one_rank_stops_both_at_the_same_step(tmp_path):
    run_two_processes(WORKER, str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["interrupted"] for r in ranks] == [True, True]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 2  # the step running when rank 1 asked, finished
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"] == str(tmp_path / "run" / "phase-0" / "checkpoint-2")
    assert ranks[1]["reason"] == "SIGTERM" and ranks[0]["reason"] == "stop requested on another process"
    state = json.loads((tmp_path / "run" / "phase-0" / "checkpoint-2" / "prorl_state.json").read_text())
    assert state["phase_complete"] is False and state["global_step"] == 2
    assert not (tmp_path / "run" / "final").exists()
