"""Resume after an in-phase hard reset (`HardResetCallback`) must also reproduce the uninterrupted run.

Regression test: an in-loop reset builds a new LR schedule over the phase's *remaining* steps, and a checkpoint holds
only the scheduler's `state_dict` (LambdaLR keeps no lambda). Before the trainer stored that horizon in
`prorl_state.json`, a resume rebuilt the schedule over the whole phase: the learning rate differed after the resume
point and the weights drifted by ~8e-3.
"""

import pytest
from test_resume import CrashDuringSave, Interrupted, make_trainer, weights

from prorl_trl.trainer.callbacks import HardResetCallback


def test_resume_after_in_phase_reset_matches_uninterrupted_run(tmp_path):
    uninterrupted = make_trainer(tmp_path / "a", callbacks=[HardResetCallback(every_steps=3)])
    uninterrupted.train()

    ref = [None]
    crashing = make_trainer(tmp_path / "b", callbacks=[HardResetCallback(every_steps=3), CrashDuringSave(ref)])
    ref[0] = crashing
    with pytest.raises(Interrupted):
        crashing.train()

    resumed = make_trainer(tmp_path / "b", callbacks=[HardResetCallback(every_steps=3)])
    resumed.train(resume_from_checkpoint=True)
    assert resumed.prorl_resets == uninterrupted.prorl_resets == 2  # phase boundary + in-loop at global step 3
    wa, wc = weights(uninterrupted), weights(resumed)
    assert max((wa[k] - wc[k]).abs().max().item() for k in wa) < 1e-6
