"""A non-finite gradient stops the run before the update reaches the weights, naming the last good checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import _cli_fork
import pytest
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState

from prorl_trl.trainer import ProRLTrainer
from prorl_trl.trainer.finite import NonFiniteGuard, NonFiniteUpdate, local_gradient_norm, scaler_takes_the_step
from tests._prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model


def length_reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


class OverflowAtStep(TrainerCallback):
    """Makes the training forward of one optimizer step overflow (its final norm's output times inf, as a bf16
    activation that overflows): the loss and every gradient of that step are NaN; generation is untouched."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.step, self.active = step, False
        model.model.norm.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        return output * math.inf if self.active and torch.is_grad_enabled() else output

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


class TrainableAfterEachStep(TrainerCallback):
    def __init__(self):
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots[state.global_step] = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }


def run(tmp_path: Path, stop_on_nonfinite: bool, max_steps: int = 4) -> tuple[ProRLTrainer, TrainableAfterEachStep]:
    model, tokenizer = tiny_model()
    record, overflow = TrainableAfterEachStep(), OverflowAtStep(model, step=3)
    record.overflow = overflow
    args = tiny_args(
        tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, stop_on_nonfinite=stop_on_nonfinite
    )
    trainer = ProRLTrainer(
        model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
        processing_class=tokenizer, peft_config=lora(), callbacks=[record, overflow],
    )  # fmt: skip
    return trainer, record


def test_a_nan_gradient_stops_before_the_update_and_names_the_last_good_checkpoint(tmp_path):
    trainer, record = run(tmp_path, stop_on_nonfinite=True)
    with pytest.raises(NonFiniteUpdate) as stopped:
        trainer.train()
    error = stopped.value
    assert error.global_step == 3 and not error.applied and not math.isfinite(error.norm)
    assert error.checkpoint is not None and error.checkpoint.name == "checkpoint-2"
    assert "checkpoint-2" in str(error) and "not applied" in str(error)
    lora_names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert error.gradients == len(lora_names) and sorted(error.nonfinite_names) == sorted(lora_names)
    assert f"in {len(lora_names)} of this process's {len(lora_names)} gradients (all: the loss" in str(error)
    assert "kl_clamp" not in str(error)  # beta 0: no KL term to bound
    now = {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(now) == set(record.snapshots[2]) and 3 not in record.snapshots
    for name, value in now.items():  # the weights are those of step 2, the checkpoint's: the NaN update never landed
        assert torch.equal(value, record.snapshots[2][name]), name


class NanGradientAtStep(TrainerCallback):
    """Makes one parameter's gradient NaN in one optimizer step (a tensor hook on it), as one layer's kernel would."""

    def __init__(self, parameter: torch.nn.Parameter, step: int):
        self.step, self.active = step, False
        parameter.register_hook(lambda grad: grad * math.nan if self.active else grad)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


def test_the_message_names_the_gradients_that_were_not_finite_before_clipping(tmp_path):
    """Clipping by a NaN total norm makes every gradient NaN; the guard notes the broken ones before it
    (`ProRLTrainer._clip_grad_norm`, a transformers internal: this test fails if transformers stops calling it), so
    a run that stops names the one layer, not "all: the loss itself"."""
    trainer, record = run(tmp_path, stop_on_nonfinite=True)
    record.overflow.step = 0  # the whole loss's overflow never fires here
    named = dict(trainer.model.named_parameters())
    target = next(name for name, p in named.items() if p.requires_grad and "lora_B" in name)
    trainer.add_callback(NanGradientAtStep(named[target], step=3))
    assert trainer.args.max_grad_norm > 0
    with pytest.raises(NonFiniteUpdate) as stopped:
        trainer.train()
    assert stopped.value.global_step == 3 and stopped.value.nonfinite_names == [target]
    assert "(only these: one part of the model), first " in str(stopped.value)


def test_fp16_overflows_are_the_loss_scalers_to_skip_until_its_scale_is_down_to_one(tmp_path):
    """Under fp16 the scaled gradients overflow by design now and then; the scaler skips such a step and halves its
    scale. The guard stops a run only once the scale is down to 1 (the gradients are not finite unscaled either)."""
    from accelerate import Accelerator

    assert scaler_takes_the_step(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert not scaler_takes_the_step(torch.amp.GradScaler("cpu", init_scale=1.0))
    assert not scaler_takes_the_step(torch.amp.GradScaler("cpu", enabled=False)) and not scaler_takes_the_step(None)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    model.weight.grad[0, 0] = math.inf
    guard, holder = NonFiniteGuard(), type("Holder", (), {})()
    holder.accelerator = Accelerator(cpu=True)
    guard.bind(holder)
    args = tiny_args(tmp_path)
    holder.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard.on_pre_optimizer_step(args, TrainerState(), TrainerControl(), optimizer=optimizer, model=model)  # no stop
    holder.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with pytest.raises(NonFiniteUpdate):
        guard.on_pre_optimizer_step(args, TrainerState(), TrainerControl(), optimizer=optimizer, model=model)


def test_without_the_guard_the_same_run_trains_on_into_nan_weights(tmp_path):
    """What the guard prevents, and proof that the poisoned step does reach the weights without it (a fourth step
    would then fail to sample on the CPU; the GPU's rollout engine samples garbage without a word)."""
    trainer, record = run(tmp_path, stop_on_nonfinite=False, max_steps=3)
    trainer.train()
    assert not any(isinstance(callback, NonFiniteGuard) for callback in trainer.callback_handler.callbacks)
    assert all(torch.isfinite(v).all() for v in record.snapshots[2].values())
    assert any(not torch.isfinite(v).all() for v in record.snapshots[3].values())


def test_the_gradient_norm_sees_nan_and_inf_and_does_not_overflow_in_float16():
    weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float16))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    assert local_gradient_norm(optimizer) == 0.0  # no gradients yet
    weight.grad = torch.full((4, 4), 60000.0, dtype=torch.float16)  # finite; its norm (240000) is not a float16
    assert local_gradient_norm(optimizer) == pytest.approx(240000.0)
    weight.grad[1, 2] = float("inf")
    assert local_gradient_norm(optimizer) == math.inf
    weight.grad[0, 0] = float("nan")
    assert math.isnan(local_gradient_norm(optimizer))


def test_where_gradients_are_out_of_reach_the_logged_norm_stops_the_run_and_says_the_update_landed(tmp_path):
    """DeepSpeed's path: no pre-step look, so the logged `grad_norm` decides (the update was applied)."""
    guard = NonFiniteGuard()
    args = tiny_args(tmp_path)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 7
    guard.on_log(args, state, control, logs={"grad_norm": 0.5, "loss": 0.1})  # finite: nothing happens
    with pytest.raises(NonFiniteUpdate) as stopped:
        guard.on_log(args, state, control, logs={"grad_norm": float("nan")})
    assert stopped.value.applied and stopped.value.global_step == 7 and stopped.value.checkpoint is None
    assert "was applied" in str(stopped.value) and "No checkpoint" in str(stopped.value)


def test_under_deepspeed_every_steps_norm_is_checked_before_the_step_is_counted_or_saved(tmp_path):
    """`ProRLTrainer._get_grad_norm` hands the engine's norm over at each step, before transformers counts the step
    (so the step named is the one just applied, global step + 1) and before any checkpoint; the logged norm is then
    not looked at again. Before 2026-11-29 only logging steps were checked: a checkpoint between them could be saved
    from NaN weights and named good."""
    guard = NonFiniteGuard()
    args = tiny_args(tmp_path)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 7
    guard.check_landed_norm(args, state, torch.tensor(0.5))  # finite: nothing happens
    guard.check_landed_norm(args, state, None)  # no norm reported: nothing to check
    with pytest.raises(NonFiniteUpdate) as stopped:
        guard.check_landed_norm(args, state, torch.tensor(float("inf")))
    assert stopped.value.applied and stopped.value.global_step == 8 and "was applied" in str(stopped.value)
    guard.on_log(args, state, control, logs={"grad_norm": float("nan")})  # already checked at its step


def test_transformers_asks_the_trainer_for_each_optimizer_steps_norm(tmp_path):
    """The hook the DeepSpeed check sits in (`Trainer._get_grad_norm`, a transformers internal) runs once per
    optimizer step: this fails if transformers moves it."""
    calls = []

    class Counting(ProRLTrainer):
        def _get_grad_norm(self, model, grad_norm=None):
            calls.append(self.state.global_step)
            return super()._get_grad_norm(model, grad_norm=grad_norm)

    model, tokenizer = tiny_model()
    trainer = Counting(model=model, reward_funcs=[length_reward], args=tiny_args(tmp_path, max_steps=2),
                       train_dataset=prompts_dataset(), processing_class=tokenizer, peft_config=lora())  # fmt: skip
    trainer.train()
    assert calls == [0, 1]


def test_trl_gives_padding_positions_log_prob_zero_so_the_kl_term_cannot_overflow_there(tmp_path):
    """A NaN source ruled out (benchmarks/results/prolonged.md): TRL 1.16 labels padding -100, so its log-probs there
    are exactly 0 for the policy and the reference alike, and `exp(ref - logp)` is 1, however far the policy has
    drifted at the pad token. If TRL stops doing this, padding can overflow the KL term and this test fails."""
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.lm_head.bias[tokenizer.pad_token_id] = -500.0  # a policy that drifted far at a token never sampled
    trainer = ProRLTrainer(
        model=model, reward_funcs=[length_reward], args=tiny_args(tmp_path, beta=0.04), train_dataset=prompts_dataset(),
        processing_class=tokenizer, peft_config=lora(),
    )  # fmt: skip
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, 7, 9, 10, 11, eos], [5, 6, 8, 12, eos, pad, pad]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)[0]
    assert torch.equal(logps[1, 2:], torch.zeros(2)) and (logps[mask[:, -4:].bool()] < 0).all()


def test_the_message_names_the_gradients_that_are_not_finite_and_suggests_kl_clamp_only_where_it_applies(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    model[1].weight.grad[0, 0] = float("nan")
    guard, state, control = NonFiniteGuard(), TrainerState(), TrainerControl()
    for beta, kl_clamp, suggested in [(0.001, False, True), (0.001, True, False), (0.0, False, False)]:
        args = tiny_args(tmp_path, beta=beta, kl_clamp=kl_clamp)
        with pytest.raises(NonFiniteUpdate) as stopped:
            guard.on_pre_optimizer_step(args, state, control, optimizer=optimizer, model=model)
        assert stopped.value.nonfinite_names == ["1.weight"] and stopped.value.gradients == 4
        assert "in 1 of this process's 4 gradients (only these: one part of the model), first 1.weight" in str(
            stopped.value
        )
        assert ("kl_clamp" in str(stopped.value)) is suggested


def test_the_stopped_steps_batches_and_weights_are_kept_and_a_replay_finds_the_operation(tmp_path):
    """The guard writes the step's micro-batches and pre-update weights; replaying them in the same trainer makes the
    same NaN and names the first module whose output was not finite (the final norm the test overflows) and the first
    backward operation that returned NaN; with the overflow gone the same batches give finite gradients."""
    from prorl_trl.trainer.replay import replay_nonfinite

    trainer, record = run(tmp_path, stop_on_nonfinite=True)
    with pytest.raises(NonFiniteUpdate) as stopped:
        trainer.train()
    dump = Path(trainer.args.output_dir) / "nonfinite" / "step-3"
    assert stopped.value.dump == dump and f"{dump}/" in str(stopped.value)
    payload = torch.load(dump / "rank-0.pt", weights_only=True)
    assert payload["step"] == 3 and len(payload["batches"]) >= 1 and payload["nonfinite"] == stopped.value.nonfinite_names
    for name, value in payload["trainable"].items():  # the weights the NaN gradients were computed at: step 2's
        assert torch.equal(value, record.snapshots[2][name]), name
    with torch.no_grad():  # move the weights away: the replay must load the file's
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    record.overflow.active = True
    replayed = replay_nonfinite(trainer, dump / "rank-0.pt")
    assert len(replayed) == len(payload["batches"]) and not any(r["gradients_finite"] for r in replayed)
    assert all(r["first_nonfinite_output"].endswith("model.norm") and not math.isfinite(r["loss"]) for r in replayed)
    assert all("returned nan" in r["error"] and r["forward"] for r in replayed), replayed
    record.overflow.active = False
    replayed = replay_nonfinite(trainer, dump / "rank-0.pt")
    assert all(r["gradients_finite"] and math.isfinite(r["loss"]) and "error" not in r for r in replayed), replayed
    assert all(r["first_nonfinite_output"] is None for r in replayed)
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), record.snapshots[2][name]), name


# ---------------------------------------------------------------------------------------- skipping (recovery)
def test_a_skipped_step_leaves_the_weights_and_optimizer_state_as_before_it_and_the_run_goes_on(tmp_path):
    """`max_nonfinite_skips`: the NaN step's update is dropped (weights and Adam moments those of step 2), it is
    recorded and kept for a replay, and the steps after it train as usual."""
    trainer, record = run(tmp_path, stop_on_nonfinite=True)
    trainer.args.max_nonfinite_skips = 1
    moments = {}

    class AdamMoments(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            moments[state.global_step] = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}

    trainer.add_callback(AdamMoments())
    trainer.train()
    assert trainer.state.global_step == 4 and [e["step"] for e in trainer.prorl_nonfinite_skips] == [3]
    event = trainer.prorl_nonfinite_skips[0]
    assert event["grad_norm"] == "nan" and event["nonfinite_gradients"] == event["gradients"] > 0
    assert event["kept"] == "nonfinite/step-3" and (Path(trainer.args.output_dir) / event["kept"] / "rank-0.pt").is_file()
    for name, value in record.snapshots[3].items():  # step 3 changed nothing
        assert torch.equal(value, record.snapshots[2][name]), name
    assert all(torch.equal(moments[3][key], moments[2][key]) for key in moments[2])
    assert any(not torch.equal(record.snapshots[4][n], record.snapshots[3][n]) for n in record.snapshots[3])  # step 4 trains
    assert all(torch.isfinite(v).all() for v in record.snapshots[4].values())
    logged = [e.get("prorl/nonfinite_skips") for e in trainer.prorl_log_history if "loss" in e]
    assert logged == [None, None, 1, 1]  # from the skipped step on; a clean run logs no such key


def test_one_more_non_finite_step_than_the_bound_stops_the_run_and_names_the_skipped_ones(tmp_path):
    trainer, record = run(tmp_path, stop_on_nonfinite=True, max_steps=6)
    trainer.args.max_nonfinite_skips = 1
    overflow = record.overflow
    overflow.on_step_begin = lambda args, state, control, **kwargs: setattr(overflow, "active", state.global_step + 1 in (3, 5))
    with pytest.raises(NonFiniteUpdate) as stopped:
        trainer.train()
    assert stopped.value.global_step == 5 and [e["step"] for e in trainer.prorl_nonfinite_skips] == [3]
    assert "non-finite step 2 of this run: max_nonfinite_skips=1 skipped the earlier ones (global steps 3)" in str(stopped.value)
    assert "checkpoint-4" in str(stopped.value)


def test_skipping_is_refused_where_it_cannot_be_honoured(tmp_path):
    from prorl_trl.reset import ZERO2, Engine
    from prorl_trl.trainer.checks import check_launch

    args = tiny_args(tmp_path, max_nonfinite_skips=2)
    with pytest.raises(ValueError, match="cannot be honoured under .*DeepSpeed keeps the gradients"):
        check_launch(args, Engine(kind=ZERO2, label="DeepSpeed ZeRO-2"), [], None, None, [])


# ------------------------------------------------------------------------------ through `prorl-trl train` (CLI)
REPO = Path(__file__).resolve().parent.parent
SHAPE = [
    "--rewards", "[token_hash]", "--training.save_strategy", "steps", "--training.save_steps", "1",
    "--phases.0.max_steps", "3", "--phases.1.max_steps", "3", "--validation.eval_steps", "3",
]  # fmt: skip


def cli(out: Path, tiny_dir: Path, shared_data: Path, *extra: str, nan_at: str = "", kill_at: str = ""):
    """`prorl-trl train` on the tiny GSM8K recipe (two phases of 3 steps) through tests/_kill_launcher.py, which makes
    the training forward of the steps in `nan_at` overflow (`PRORL_TEST_NAN_AT`)."""
    import os
    import sys

    command = [sys.executable, str(REPO / "tests" / "_kill_launcher.py"), "train", str(REPO / "tests" / "recipes" / "tiny_gsm8k.yaml"),
               "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out), *SHAPE, *extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data), "PRORL_TEST_NAN_AT": nan_at,
           "PRORL_TEST_KILL_AT": kill_at}  # fmt: skip
    return _cli_fork.run(command, cwd=REPO, env=env, timeout=300)


def test_the_cli_skips_a_nan_step_within_the_bound_and_records_it(tiny_dir, shared_data, tmp_path):
    import json

    out = tmp_path / "run"
    result = cli(out, tiny_dir, shared_data, "--training.max_nonfinite_skips", "1", nan_at="0:2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Skipped global step 2 (phase 'first'): its gradients are not finite" in result.stderr
    assert "skipped (gradients not finite): global steps 2" in result.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 6 and summary["nonfinite_skips"] == 1
    assert [event["step"] for event in summary["nonfinite_skipped_steps"]] == [2]
    assert (out / "nonfinite" / "step-2" / "rank-0.pt").is_file()
    assert summary["cudnn_attention_guard"]["mode"] == "auto" and "no CUDA device" in summary["cudnn_attention_guard"]["message"]
    from prorl_trl.trainer.manifest import read_manifest

    assert "nonfinite/" in read_manifest(out)  # the kept step is the run's: --overwrite deletes it too


def test_the_cli_stops_past_the_bound_and_the_count_survives_a_resume(tiny_dir, shared_data, tmp_path):
    out = tmp_path / "run"
    bound = ["--training.max_nonfinite_skips", "1"]
    result = cli(out, tiny_dir, shared_data, *bound, nan_at="0:1", kill_at="on_step_begin:0:3")
    assert result.returncode == -9 and "Skipped global step 1" in result.stderr, result.stderr[-3000:]
    result = cli(out, tiny_dir, shared_data, *bound, "--resume", nan_at="0:3")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Training stopped at global step 3 (phase 'first')" in result.stderr
    assert "max_nonfinite_skips=1 skipped the earlier ones (global steps 1)" in result.stderr
    assert "resume with:" in result.stderr and "Traceback" not in result.stderr
