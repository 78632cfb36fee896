"""`ValidationCallback`: pass@k of the live policy on held-out problems, every `eval_steps` optimizer steps.

It samples with the same code as `prorl-trl eval` (`sample_transformers`, `grade`, `pass_at_k`) so validation
numbers and offline evaluation numbers mean the same thing, and logs `eval_pass@1`, `eval_pass@<k>`, `eval_reward`
(mean graded reward) and `eval_mean_length` as one `log_history` entry that every callback's `on_log` sees (the
plateau rule watches `args.plateau_metric` there).

Why it logs through `transformers.Trainer.log` and not `trainer.log`: `GRPOTrainer.log` averages and then clears
`trainer._metrics["train" or "eval"]` (the mode is read from `model.training`). Calling it mid-interval would flush
TRL's half-collected training metrics into our entry, or (in eval mode) dump the completions table. The base
`Trainer.log` only appends to `state.log_history` and fires `on_log`; `tests/test_eval_validation.py` guards both facts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from .grading import grade, resolve_reward
from .passk import pass_at_k_per_problem
from .sampling import SamplingSettings, render_prompt, sample_transformers


def _first_rows(dataset: Any, num_problems: int | None) -> list[dict[str, Any]]:
    count = len(dataset) if num_problems is None else min(num_problems, len(dataset))
    if hasattr(dataset, "select"):
        return [dict(row) for row in dataset.select(range(count))]
    return [dict(row) for row in list(dataset)[:count]]


class ValidationCallback(TrainerCallback):
    """Validate the policy during training: n samples on each of the first `num_problems` problems.

    Args:
        dataset: rows with a `prompt` column and the gold columns the reward reads (a `datasets.Dataset` or dicts).
        reward_func: a registry name (`rewards.get_reward`) or a TRL-style reward callable.
        eval_steps: validate when `global_step` is a multiple of this (its own schedule, not `args.eval_steps`).
        num_problems: the first N problems of `dataset` (None: all).
        num_samples: completions per problem (n of pass@k).
        temperature, top_p, max_completion_length: validation sampling (ProRL validates at its own settings).
        ks: k values logged as `eval_pass@<k>` (1 is always logged).
        batch_size: sequences per `generate` call.
        eval_on_start: also validate before the first step (the "before" point of a curve).
        seed: sampling seed; sampling runs under a forked RNG, so validation never changes the training trajectory.
        trainer: the trainer, for plain `GRPOTrainer`s; `ProRLTrainer` calls `bind(trainer)` itself.
    """

    def __init__(
        self,
        dataset: Any,
        reward_func: str | Callable,
        eval_steps: int = 50,
        num_problems: int | None = None,
        num_samples: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_completion_length: int = 256,
        ks: Sequence[int] = (1,),
        batch_size: int = 64,
        eval_on_start: bool = False,
        seed: int = 0,
        metric_prefix: str = "eval_",
        trainer: Trainer | None = None,
    ):
        if eval_steps < 1:
            raise ValueError(f"ValidationCallback: eval_steps must be >= 1, got {eval_steps}.")
        self.ks = sorted({1, *(int(k) for k in ks)})
        if self.ks[0] < 1 or self.ks[-1] > num_samples:
            raise ValueError(f"ValidationCallback: every k must be in [1, num_samples={num_samples}], got {list(ks)}.")
        rows = _first_rows(dataset, num_problems)
        if not rows:
            raise ValueError("ValidationCallback: the validation dataset is empty.")
        if "prompt" not in rows[0]:
            raise ValueError(f"ValidationCallback: validation rows need a `prompt` column, got {sorted(rows[0])}.")
        self.rows = rows
        self.reward_func = resolve_reward(reward_func)
        self.settings = SamplingSettings(
            num_samples=num_samples, temperature=temperature, top_p=top_p,
            max_completion_length=max_completion_length, batch_size=batch_size, seed=seed,
        )
        self.eval_steps = eval_steps
        self.eval_on_start = eval_on_start
        self.metric_prefix = metric_prefix
        self.trainer = trainer
        self.last_metrics: dict[str, float] | None = None

    def bind(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _require_trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(
                "ValidationCallback needs the trainer: pass `trainer=` when building it after the trainer, or "
                "`trainer.add_callback(cb); cb.bind(trainer)` (ProRLTrainer binds automatically)."
            )
        return self.trainer

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Sample, grade and aggregate on this process's share of problems; returns the metrics (all processes)."""
        trainer = self._require_trainer()
        from accelerate.utils import gather_object
        from trl.models import unwrap_model_for_generation

        accelerator = trainer.accelerator
        mine = list(range(accelerator.process_index, len(self.rows), accelerator.num_processes))
        tokenizer = trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap a tokenizer
        rows = [self.rows[i] for i in mine]
        texts = [render_prompt(row["prompt"], tokenizer) for row in rows]
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
                    completions, _ = sample_transformers(model, tokenizer, texts, self.settings)
            finally:
                model.train(was_training)
                trainer.model.train(was_training)
        completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
        rewards, correct = grade(
            self.reward_func, [rows[c.prompt_index]["prompt"] for c in completions], [c.text for c in completions],
            [rows[c.prompt_index] for c in completions],
        )
        index = np.array([c.prompt_index for c in completions], dtype=int)
        solved = np.bincount(index, weights=np.array(correct, dtype=float), minlength=len(rows))
        values = np.array(rewards, dtype=float)
        reward_sum = np.bincount(index, weights=np.nan_to_num(values), minlength=len(rows))
        scored = np.bincount(index, weights=(~np.isnan(values)).astype(float), minlength=len(rows))
        tokens = np.bincount(index, weights=np.array([c.num_tokens for c in completions], dtype=float), minlength=len(rows))
        local = [(int(solved[i]), float(reward_sum[i]), float(tokens[i]), float(scored[i])) for i in range(len(rows))]
        gathered = gather_object(local) if accelerator.num_processes > 1 else local
        n = self.settings.num_samples
        counts = np.array([g[0] for g in gathered])
        metrics = {f"pass@{k}": float(pass_at_k_per_problem(np.full(len(counts), n), counts, k).mean()) for k in self.ks}
        scored_total = sum(g[3] for g in gathered)  # rewards that returned None are left out of the mean
        metrics["reward"] = float(sum(g[1] for g in gathered) / scored_total) if scored_total else float("nan")
        metrics["mean_length"] = float(sum(g[2] for g in gathered) / (n * len(gathered)))
        return {f"{self.metric_prefix}{key}": value for key, value in metrics.items()}

    def _validate_and_log(self) -> None:
        trainer = self._require_trainer()
        self.last_metrics = self.evaluate()
        Trainer.log(trainer, dict(self.last_metrics))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.eval_on_start and state.global_step == 0:
            self._validate_and_log()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 0 and state.global_step % self.eval_steps == 0:
            self._validate_and_log()
