"""`ValidationCallback`: pass@k of the live policy on held-out problems, every `eval_steps` optimizer steps.

It samples with the same code as `prorl-trl eval` (`sample_transformers`, `grade`, `pass_at_k`), so validation and
offline evaluation numbers mean the same thing, and logs `eval_pass@1`, `eval_pass@<k>`, `eval_reward` (mean graded
reward) and `eval_mean_length` as one `log_history` entry that every callback's `on_log` sees (the plateau rule
watches `args.plateau_metric` there). The per-problem correct counts behind those numbers stay on the callback
(`last_correct`, set before the entry is logged), not in the entry: `log_history` is printed and checkpointed, and a
list per problem would swell both; a caller that wants them (which problems became solvable) reads them in `on_log`.

How it logs: through `trainer.log`, so subclasses add their keys (ProRLTrainer's `prorl/*`), but with the model in
eval mode, `trainer._metrics` swapped for empty buffers and `trainer.log_completions` off for the call. Reason:
`GRPOTrainer.log` (trl 1.16) averages and then *clears* `self._metrics["train" if model.training else "eval"]` and
dumps its completions table; logging mid-interval without the swap would flush TRL's half-collected training metrics
into our entry. It also restores `control.should_log`, which `on_log` resets (else HF would skip this step's
training log). `tests/test_eval_validation.py` guards these private attributes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from .grading import grade, resolve_reward
from .passk import pass_at_k_per_problem
from .sampling import SamplingSettings, encode_prompt, sample_transformers


def _first_rows(dataset: Any, num_problems: int | None) -> list[dict[str, Any]]:
    count = len(dataset) if num_problems is None else min(num_problems, len(dataset))
    if hasattr(dataset, "select"):
        return [dict(row) for row in dataset.select(range(count))]
    return [dict(row) for row in list(dataset)[:count]]


class ValidationCallback(TrainerCallback):
    """Validate the policy during training: `num_generations` samples on each of the first `num_problems` problems.

    Args:
        dataset: rows with a `prompt` column and the gold columns the reward reads (a `datasets.Dataset` or dicts).
        reward_func: a registry name (`rewards.get_reward`) or a TRL-style reward callable.
        eval_steps: validate when `state.global_step` is a multiple of this (its own schedule, not `args.eval_steps`).
        num_problems: the first N problems of `dataset` (None: all).
        num_generations: completions per problem (the n of pass@k).
        temperature, top_p: validation sampling (ProRL validates at its own settings, not the phase's).
        max_completion_length: validation cap; None: the trainer's current `max_completion_length`.
        ks: k values logged as `eval_pass@<k>` (1 is always logged); each <= `num_generations`.
        batch_size: prompts per `generate` call (x `num_generations` sequences).
        at_start: also validate before the first optimizer step (once per callback, not per phase).
        seed: sampling seed. Sampling runs under a forked RNG, so validation never changes the training trajectory.
        metric_prefix: prefix of the logged keys.
        trainer: the trainer, for a plain `GRPOTrainer`; `ProRLTrainer` calls `bind(trainer)` itself.
    """

    def __init__(
        self,
        dataset: Any,
        reward_func: str | Callable,
        eval_steps: int = 50,
        num_problems: int | None = None,
        num_generations: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_completion_length: int | None = None,
        ks: Sequence[int] = (1,),
        batch_size: int = 16,
        at_start: bool = False,
        seed: int = 0,
        metric_prefix: str = "eval_",
        trainer: Trainer | None = None,
    ):
        if eval_steps < 1:
            raise ValueError(f"ValidationCallback: eval_steps must be >= 1, got {eval_steps}.")
        if batch_size < 1:
            raise ValueError(f"ValidationCallback: batch_size must be >= 1, got {batch_size}.")
        self.ks = sorted({1, *(int(k) for k in ks)})
        if self.ks[0] < 1 or self.ks[-1] > num_generations:
            raise ValueError(
                f"ValidationCallback: every k must be in [1, num_generations={num_generations}], got {list(ks)}."
            )
        self.rows = _first_rows(dataset, num_problems)
        if not self.rows:
            raise ValueError("ValidationCallback: the validation dataset is empty.")
        if "prompt" not in self.rows[0]:
            raise ValueError(f"ValidationCallback: validation rows need a `prompt` column, got {sorted(self.rows[0])}.")
        self.reward_func = resolve_reward(reward_func)
        self.settings = SamplingSettings(  # checks the values now, before training starts
            num_samples=num_generations, temperature=temperature, top_p=top_p,
            max_completion_length=max_completion_length or 1, batch_size=batch_size * num_generations, seed=seed,
        )
        self.max_completion_length = max_completion_length
        self.eval_steps = eval_steps
        self.at_start = at_start
        self.metric_prefix = metric_prefix
        self.trainer = trainer
        self.last_metrics: dict[str, float] | None = None
        self.last_correct: list[int] | None = None  # correct samples of each problem (order of the dataset's rows)
        self._started = False
        self._engine = None  # validation's own RolloutEngine (its shapes differ from training's)

    def bind(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _require_trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(
                "ValidationCallback needs the trainer: pass `trainer=` (build the callback after the trainer, then "
                "`trainer.add_callback(callback)`), or call `callback.bind(trainer)`; ProRLTrainer binds automatically."
            )
        return self.trainer

    def prompt_ids(self, prompts: Sequence[Any]) -> list[list[int]]:
        """`prompts` tokenised as the trainer tokenises training prompts, `GRPOConfig.chat_template_kwargs` included
        (TRL 1.16 keeps them on `trainer.chat_template_kwargs` and passes them to `apply_chat_template`)."""
        trainer = self._require_trainer()
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # processors wrap one
        template_kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
        return [encode_prompt(prompt, tokenizer, template_kwargs) for prompt in prompts]

    def _settings(self, trainer: Trainer) -> SamplingSettings:
        """Validation's sampling; the rollout engine exactly when the trainer generates with one (ProRLConfig)."""
        cap = self.max_completion_length or getattr(trainer, "max_completion_length", None)
        if cap is None:
            raise ValueError("ValidationCallback: set max_completion_length (the trainer has none to inherit).")
        engine = getattr(trainer, "rollout_engine", None) is not None
        return SamplingSettings(**{**self.settings.to_dict(), "max_completion_length": int(cap), "rollout_engine": engine})

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Sample and grade this process's share of the problems; returns the metrics gathered over all processes."""
        from accelerate.utils import gather_object
        from trl.models import unwrap_model_for_generation

        trainer = self._require_trainer()
        accelerator = trainer.accelerator
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # processors wrap one
        rows = self.rows[accelerator.process_index :: accelerator.num_processes]
        encoded = self.prompt_ids([row["prompt"] for row in rows])
        settings = self._settings(trainer)
        if settings.rollout_engine and self._engine is None:
            from prorl_trl.rollout.engine import RolloutEngine

            self._engine = RolloutEngine(cuda_graphs=trainer.rollout_engine.cuda_graphs, compile=trainer.rollout_engine.compile)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        was_training = trainer.model.training
        with unwrap_model_for_generation(
            trainer.model_wrapped, accelerator,
            gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
            gradient_checkpointing_kwargs=getattr(trainer.args, "gradient_checkpointing_kwargs", None),
        ) as model, torch.random.fork_rng(devices=devices):
            model.eval()
            try:
                with accelerator.autocast():
                    completions, _ = (
                        sample_transformers(model, tokenizer, encoded, settings, engine=self._engine) if rows else ([], {})
                    )
            finally:
                model.train(was_training)
        rewards, correct = grade(
            self.reward_func, [rows[c.prompt_index]["prompt"] for c in completions], [c.text for c in completions],
            [rows[c.prompt_index] for c in completions],
        )
        index = np.array([c.prompt_index for c in completions], dtype=int)
        values = np.array(rewards, dtype=float)
        per_problem = np.stack([
            np.bincount(index, weights=np.array(correct, dtype=float), minlength=len(rows)),
            np.bincount(index, weights=np.nan_to_num(values), minlength=len(rows)),
            np.bincount(index, weights=(~np.isnan(values)).astype(float), minlength=len(rows)),
            np.bincount(index, weights=np.array([c.num_tokens for c in completions], dtype=float), minlength=len(rows)),
        ], axis=1) if completions else np.zeros((0, 4))
        local = [tuple(row) for row in per_problem.tolist()]
        table = np.array(gather_object(local) if accelerator.num_processes > 1 else local, dtype=float)
        n = settings.num_samples
        solved = table[:, 0].round().astype(int)
        # gather_object concatenates the processes' strided shares (process p held rows p, p + P, ...)
        processes, count = accelerator.num_processes, len(self.rows)
        order = [i for p in range(processes) for i in range(p, count, processes)]
        self.last_correct = [0] * count
        for position, value in zip(order, solved.tolist()):
            self.last_correct[position] = value
        metrics = {f"pass@{k}": float(pass_at_k_per_problem(np.full(len(solved), n), solved, k).mean()) for k in self.ks}
        scored = table[:, 2].sum()  # rewards that returned None are left out of the mean
        metrics["reward"] = float(table[:, 1].sum() / scored) if scored else float("nan")
        metrics["mean_length"] = float(table[:, 3].sum() / (n * len(table)))
        return {f"{self.metric_prefix}{key}": value for key, value in metrics.items()}

    def _validate_and_log(self) -> None:
        trainer = self._require_trainer()
        self.last_metrics = self.evaluate()
        # `CallbackHandler.on_log` clears `control.should_log`; during `on_step_end` that would cancel the training
        # log HF is about to write for this step, so the flag is put back.
        should_log = trainer.control.should_log
        with _quiet_grpo_log(trainer):
            trainer.log(dict(self.last_metrics))
        trainer.control.should_log = should_log

    def on_train_begin(self, args, state, control, **kwargs):
        # A ProRL run calls train() per phase and may resume in a new process: "at start" means step 0 of the run.
        run_step = getattr(self.trainer, "prorl_global_step", state.global_step)
        if self.at_start and not self._started and state.global_step == 0 and run_step == 0:
            self._validate_and_log()
        self._started = True

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 0 and state.global_step % self.eval_steps == 0:
            self._validate_and_log()


@contextmanager
def _quiet_grpo_log(trainer: Trainer):
    """Make `trainer.log` append our entry without flushing TRL's metric buffers or completions table (see module doc)."""
    was_training = trainer.model.training
    saved_metrics = getattr(trainer, "_metrics", None)
    saved_completions = getattr(trainer, "log_completions", None)
    if saved_metrics is not None:
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    if saved_completions is not None:
        trainer.log_completions = False
    trainer.model.eval()  # GRPOTrainer/ProRLTrainer treat an eval-mode log as an evaluation entry
    try:
        yield
    finally:
        trainer.model.train(was_training)
        if saved_metrics is not None:
            trainer._metrics = saved_metrics
        if saved_completions is not None:
            trainer.log_completions = saved_completions
