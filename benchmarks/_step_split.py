"""Where a trainer's optimizer step goes: CUDA-synchronised timers around the trainer's own methods (for
`step_time.py`'s phases mode), and a profile of the rollout engine's decode step.

`StepSplit` is a `TrainerCallback` that also wraps, on one trainer instance (nothing in the package changes):
  generation    `_generate_and_score_completions` (rollout, rewards, advantages), less the log-prob forwards in it
  rollout       `_generate_single_turn` inside it (the engine or `generate`), kept apart for tokens/s
  logprob       `_get_per_token_logps_and_entropies` without grad (old / reference log-probs)
  loss_forward  `compute_loss` (its forward with grad, and the loss)
  backward      `accelerator.backward`
  optimizer     `accelerator.clip_grad_norm_` and every `Optimizer.step` (torch's global step hooks)
Each region's time is exclusive (a region inside another counts once, in the inner one), and the device is
synchronised at every region's edges, so a step's regions never overlap and the rest of the step ("other": logging,
callbacks, the scheduler, data) is the step's time less their sum. A step runs from one `on_step_begin` to the next
(the last one to `on_train_end`); anything outside a step (a hard reset between phases) is not counted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from transformers import TrainerCallback

GIB = 2**30
PARTS = ("generation", "logprob", "loss_forward", "backward", "optimizer")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepSplit(TrainerCallback):
    """Per `train()` call (a phase): every step's wall time, its split (`PARTS` + `rollout`), the completion tokens
    generated, and the peak memory over the call; `calls` holds one record per call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: list[dict[str, Any]] = []
        self._steps: list[dict[str, Any]] = []
        self._step: dict[str, Any] | None = None
        self._stack: list[list] = []  # [name, start, seconds of the regions inside it]
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------------------------------------ regions
    def enter(self, name: str) -> None:
        synchronize(self.device)
        self._stack.append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        synchronize(self.device)
        name, start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        if self._stack:
            self._stack[-1][2] += elapsed
        if self._step is not None:
            self._step["parts"][name] += elapsed - inner

    def _wrap(self, owner: Any, attribute: str, name, count_tokens: bool = False) -> None:
        """`owner.<attribute>` timed as region `name` (a callable of nothing: decided per call)."""
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            self.enter(name() if callable(name) else name)
            try:
                result = original(*args, **kwargs)
            finally:
                self.exit()
            if count_tokens and self._step is not None:  # TRL: (completion id lists, logprobs)
                self._step["tokens"] += sum(len(ids) for ids in result[0])
            return result

        setattr(owner, attribute, timed)

    def attach(self, trainer: Any) -> None:
        """Wrap `trainer`'s methods (instance attributes: its class is untouched) and hook every optimizer step."""
        self._wrap(trainer, "_generate_and_score_completions", "generation")
        self._wrap(trainer, "_generate_single_turn", "rollout", count_tokens=True)
        self._wrap(trainer, "_get_per_token_logps_and_entropies",
                   lambda: "loss_forward" if torch.is_grad_enabled() else "logprob")  # fmt: skip
        self._wrap(trainer, "compute_loss", "loss_forward")
        self._wrap(trainer.accelerator, "backward", "backward")
        self._wrap(trainer.accelerator, "clip_grad_norm_", "optimizer")
        self._hooks = [
            register_optimizer_step_pre_hook(lambda *_: self.enter("optimizer")),
            register_optimizer_step_post_hook(lambda *_: self.exit()),
        ]

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------------------------ steps
    def _close_step(self) -> None:
        synchronize(self.device)
        if self._step is not None:
            self._step["seconds"] = time.perf_counter() - self._step.pop("start")
            self._step["parts"] = dict(self._step["parts"])
            self._steps.append(self._step)
        self._step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._steps, self._step = [], None
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_step_begin(self, args, state, control, **kwargs):
        self._close_step()
        self._step = {"start": time.perf_counter(), "parts": defaultdict(float), "tokens": 0}

    def on_train_end(self, args, state, control, **kwargs):
        self._close_step()
        call: dict[str, Any] = {"steps": self._steps}
        if self.device.type == "cuda":
            call["peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            call["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
        self.calls.append(call)


def split_of(step: dict[str, Any]) -> dict[str, float]:
    """A step's seconds per column: `PARTS` (generation includes the rollout), `other` = the step less their sum."""
    parts = step["parts"]
    split = {name: parts.get(name, 0.0) for name in PARTS}
    split["generation"] += parts.get("rollout", 0.0)
    split["other"] = step["seconds"] - sum(split.values())
    return split


# ---------------------------------------------------------------------------------------------------- profile
def profile_decode(trainer: Any, prompt_ids: list[list[int]], replays: int = 2, top: int = 20) -> dict[str, Any]:
    """One generation through the trainer's rollout engine with its arena kept, then `replays` replays of its last
    CUDA graph (`steps_per_graph` decode steps each) under torch.profiler: the `top` kernels by GPU time (name, GPU
    microseconds per decode step, launches per decode step) and the kernels per decode step. The arena is released
    after it as the engine's own generation releases it, so training goes on as before."""
    from torch.profiler import ProfilerActivity, profile

    from prorl_trl.rollout import arrivals
    from prorl_trl.rollout.decoder import plan_fusions
    from prorl_trl.rollout.trl_generation import generate_completions

    engine = trainer.rollout_engine
    if engine is None:
        return {"skipped": "no rollout engine"}
    captures = engine.stats.captures
    engine.release_cache = False
    try:
        generate_completions(trainer, engine, prompt_ids)
        if engine.stats.captures == 0:
            return {"skipped": "no CUDA graph (the engine runs eagerly off CUDA)"}
        found: dict[str, Any] = {"recaptured": engine.stats.captures > captures, **engine.time_replays(8)}
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            engine.time_replays(replays)
        steps = replays * engine.steps_per_graph
        kernels = sorted(profiler.key_averages(), key=lambda event: -event.device_time_total)
        found["decode_steps_profiled"] = steps
        found["kernels_per_step"] = sum(event.count for event in kernels) / steps
        found["top_kernels"] = [
            {"name": event.key[:120], "us_per_step": round(event.device_time_total / steps, 2),
             "launches_per_step": event.count / steps} for event in kernels[:top]
        ]  # fmt: skip
        return found
    finally:
        engine.release_cache = True
        arena = engine._arena  # as `RolloutEngine.generate` releases it (benchmarks/generation.py does the same)
        if arena is not None and arena.held:
            if engine._parts is not None:
                plan_fusions(engine._parts[1])  # the stacks' entries None: nothing reads the freed buffers
            arrivals.withdraw_arrival_counters(arena.views["arrivals"])
            arena.release()
