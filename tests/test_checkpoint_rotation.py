"""`save_total_limit` prunes a phase's checkpoints only after the new one is committed (2026-11-29).

HF prunes at the end of its save, before `ProRLStateCallback.on_save` writes the commit record: with a limit of 1, a
kill between the two left the phase with no complete checkpoint, and a resume silently went back a whole phase.
"""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

from prorl_trl.reset.checkpoint import complete_checkpoints, latest_checkpoint, prune_committed_checkpoints
from prorl_trl.trainer import ProRLTrainer
from tests._prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model


class Killed(Exception):
    pass


class KillWhileSaving(TrainerCallback):
    """Raises in `on_save` at one step of one phase: after HF wrote the checkpoint, before ProRL commits it (callbacks
    given to the trainer run before its own)."""

    def __init__(self, phase: int, step: int):
        self.phase, self.step, self.trainer = phase, step, None

    def bind(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if self.trainer.current_phase.index == self.phase and state.global_step == self.step:
            raise Killed


def length_reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


def trainer_for(tmp_path, limit: int, callbacks=()) -> ProRLTrainer:
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=limit,
                     phases=[{"max_steps": 2}, {"max_steps": 4}])  # fmt: skip
    return ProRLTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
                        processing_class=tokenizer, peft_config=lora(), callbacks=list(callbacks))  # fmt: skip


def steps_by_phase(run) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for path, state in complete_checkpoints(run):
        found.setdefault(state["phase_index"], []).append(int(path.name.split("-")[1]))
    return found


def test_a_kill_between_save_and_commit_keeps_the_phases_last_complete_checkpoint(tmp_path):
    trainer = trainer_for(tmp_path, limit=1, callbacks=[KillWhileSaving(phase=1, step=3)])
    with pytest.raises(Killed):
        trainer.train()
    run = tmp_path / "run"
    assert steps_by_phase(run) == {0: [2], 1: [2]}  # phase 1's step 2 survives the uncommitted step 3
    assert latest_checkpoint(run) == run / "phase-1" / "checkpoint-2"
    assert (run / "phase-1" / "checkpoint-3").is_dir()  # written, not committed: not a checkpoint


def test_the_limit_still_holds_per_phase_once_each_save_is_committed(tmp_path):
    trainer_for(tmp_path, limit=2).train()
    assert steps_by_phase(tmp_path / "run") == {0: [1, 2], 1: [3, 4]}
    assert {state["world_size"] for _, state in complete_checkpoints(tmp_path / "run")} == {1}  # for a resume


def test_a_resume_on_another_number_of_processes_is_a_change_of_training():
    """It sets the completions per optimizer step; unknown on either side (older checkpoints, `validate`) it is
    no change. Recorded in the resume history, it is not a recipe key, so later resumes do not see it again."""
    from prorl_trl.recipe.changes import world_size_change

    change = world_size_change({"world_size": 2}, 1)
    assert change is not None and change.alters_training and change.describe() == "launch.world_size: 2 -> 1"
    assert world_size_change({"world_size": 2}, 2) is None
    assert world_size_change({}, 4) is None and world_size_change({"world_size": 2}, None) is None


def test_pruning_keeps_the_newest_and_the_best_and_never_counts_uncommitted_folders(tmp_path):
    phase = tmp_path / "phase-0"
    for step in (1, 2, 3, 4):
        (phase / f"checkpoint-{step}").mkdir(parents=True)
        if step != 4:  # 4: written, not committed
            (phase / f"checkpoint-{step}" / "prorl_state.json").write_text("{}")
    deleted = prune_committed_checkpoints(phase, 1, [phase / "checkpoint-1"])
    assert deleted == [phase / "checkpoint-2"]
    assert sorted(path.name for path in phase.iterdir()) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert prune_committed_checkpoints(phase, None) == [] and prune_committed_checkpoints(phase, 0) == []


def test_a_recorded_world_size_change_stays_out_of_the_recipe_later_resumes_compare(tmp_path):
    from prorl_trl.recipe.changes import RECORDED_RECIPE_NAME, record_resume, recorded_recipe, world_size_change

    (tmp_path / RECORDED_RECIPE_NAME).write_text("training:\n  learning_rate: 0.001\n")
    record_resume(tmp_path, [world_size_change({"world_size": 2}, 1)], str(tmp_path / "checkpoint-3"), 3)
    flat = recorded_recipe(tmp_path)
    assert "launch.world_size" not in flat and flat["training.learning_rate"] == 0.001
