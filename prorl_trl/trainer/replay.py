"""Keep what a non-finite step computed, so that it can be replayed and the operation that made the NaN found.

Why: a NaN gradient in a long run is rare and tied to one batch and one set of weights (the prolonged study's (a) and
(d) runs of one seed, the same computation until (d)'s first reset, stopped at the same step). The latest checkpoint
is up to `save_steps` earlier, and its rollouts are sampled again on a resume, so the failing batch is gone once the
run stops. `StepBatchesMixin` holds references to the current optimizer step's micro-batches (TRL keeps the
generation batch anyway), and when `NonFiniteGuard` stops the run, `write_nonfinite_dump` writes them, with the
trainable weights as they were before the update and the frozen reset factors, to
`<output_dir>/nonfinite/step-<N>/rank-<r>.pt`. `replay_nonfinite` loads such a file into a trainer built with the same
settings and recomputes each micro-batch's loss and gradients: forward hooks name the first module whose output is
not finite (a forward overflow), and `torch.autograd.detect_anomaly` names the backward operation that first returned
NaN and where its forward ran (a NaN made only in the backward).

Under FSDP2 and ZeRO the weights are sharded: only the batches are written there, and `replay_nonfinite` refuses
such a file.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .. import reset as reset_ops


class StepBatchesMixin:
    """Keeps the micro-batches `_compute_loss` saw in the optimizer step in progress (references, dropped at the next
    step), while `stop_on_nonfinite` is on; evaluation (no grad) is not kept."""

    _step_batches: list[dict[str, Any]] | None = None
    _step_batches_of: int = -1

    def _compute_loss(self, model, inputs):
        if getattr(self.args, "stop_on_nonfinite", False) and torch.is_grad_enabled():
            if self._step_batches_of != self.state.global_step:
                self._step_batches, self._step_batches_of = [], self.state.global_step
            self._step_batches.append(inputs)
        return super()._compute_loss(model, inputs)


def _moved(value: Any, device: torch.device | str) -> Any:
    """`value` with every tensor in it (dicts, lists, tuples) on `device`, detached."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {key: _moved(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(item, device) for item in value)
    return value


def write_nonfinite_dump(trainer: Any, step: int, phase: str | None, nonfinite: list[str]) -> Path | None:
    """Write the step's micro-batches (and, unsharded, the trainable weights and frozen factors) to
    `<output_dir>/nonfinite/step-<step>/rank-<r>.pt`; returns the folder, or None when there is nothing to write."""
    batches = getattr(trainer, "_step_batches", None)
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    if not batches or not output_dir:
        return None
    engine = getattr(trainer, "_engine", None)
    sharded = bool(getattr(engine, "sharded", False))
    model = reset_ops.unwrap_model(trainer.model)
    payload = {
        "step": step,
        "phase": phase,
        "nonfinite": nonfinite,
        "batches": [_moved(batch, "cpu") for batch in batches],
        "trainable": None
        if sharded
        else {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad},
        "frozen": None if sharded else reset_ops.frozen_state_dict(model),
    }
    folder = Path(output_dir) / "nonfinite" / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    rank = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
    torch.save(payload, folder / f"rank-{rank}.pt")
    return folder


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class FirstNonFinite:
    """Forward hooks on every submodule; `name` is the first whose output held a NaN or inf (inner modules finish
    first, so this is the innermost, earliest one), None while all were finite."""

    def __init__(self, model: torch.nn.Module):
        self.name: str | None = None
        self.handles = [
            module.register_forward_hook(self._hook(name)) for name, module in model.named_modules() if name
        ]

    def _hook(self, name: str):
        def hook(module, args, output):
            if self.name is None and any(
                t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(output)
            ):
                self.name = name

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def replay_nonfinite(trainer: Any, path: str | Path) -> list[dict[str, Any]]:
    """Load a `write_nonfinite_dump` file into `trainer` (built with the run's settings; its trainable weights and
    frozen factors are replaced by the file's) and recompute each micro-batch's loss and gradients under anomaly
    detection. One record per micro-batch: `loss`, `gradients_finite`, `first_nonfinite_output` (the first module
    whose forward output was not finite, or None), and where anomaly detection stopped, `error` (the backward
    operation that returned NaN) and `forward` (the end of the traceback of its forward call)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    model = reset_ops.unwrap_model(trainer.model)
    if payload["trainable"] is None:
        raise ValueError(f"{path} holds no weights (written under a sharded engine): replay from its batches by hand.")
    parameters = dict(model.named_parameters())
    missing = sorted(set(payload["trainable"]) - set(parameters))
    if missing:
        raise ValueError(f"{path} names weights this model does not have ({missing[:3]}): build the run's trainer.")
    with torch.no_grad():
        for name, value in payload["trainable"].items():
            parameters[name].copy_(value)
    reset_ops.load_frozen_(model, payload["frozen"])
    device = trainer.accelerator.device
    records = []
    trainer.model.train()
    for index, batch in enumerate(payload["batches"]):
        trainer.model.zero_grad(set_to_none=True)
        record: dict[str, Any] = {"batch": index}
        watch = FirstNonFinite(trainer.model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    loss = trainer._compute_loss(trainer.model, _moved(batch, device))
                    record["loss"] = float(loss.detach())
                    loss.backward()
            except RuntimeError as error:
                record["error"] = str(error).splitlines()[0]
                traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
                record["forward"] = "\n".join(traces[-1].strip().splitlines()[-4:]) if traces else ""
            finally:
                watch.remove()
        record["first_nonfinite_output"] = watch.name
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        record["gradients_finite"] = "error" not in record and all(bool(torch.isfinite(g).all()) for g in grads)
        records.append(record)
    trainer.model.zero_grad(set_to_none=True)
    return records
