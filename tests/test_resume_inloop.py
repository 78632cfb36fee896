"""Resume after an in-phase hard reset (`HardResetCallback`) must also reproduce the uninterrupted run.

KNOWN BUG (xfail, strict): an in-loop reset builds a new LR schedule whose horizon is the phase's *remaining* steps
(`ProRLTrainer._reset_optimizer` -> `create_scheduler(max_steps - global_step)`), but a checkpoint stores only the
scheduler's `state_dict` (LambdaLR keeps no lambda). On resume HF rebuilds the schedule over the whole phase and loads
`last_epoch` into it, so the learning rate differs after the resume point (here 0.025 instead of 0.0167 at the last
step) and the weights drift (~8e-3). Verified fix (max |diff| becomes 0.0): record the horizon at the in-loop reset,
write it to `prorl_state.json` (e.g. "scheduler_num_training_steps"), restore it in `_prepare_resume`, and override
`create_scheduler` to use it while set (clear it at each phase start). Remove the xfail marker with the fix.
"""

import pytest

from prorl_trl.callbacks import HardResetCallback
from test_resume import CrashDuringSave, Interrupted, make_trainer, weights


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="LR-schedule horizon after an in-loop reset is not checkpointed (see docstring)")
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
