"""`ProRLTrainer` and its callbacks: phases, sampling propagation, loop overrides (dynamic sampling, minibatch early
stop), when to hard-reset, and the overlong penalty.

Modules: `trainer` (ProRLTrainer: decides when), `phase_switch` (a phase's settings into TRL's live attributes),
`hard_reset` (a reset applied to the live trainer), `saves` (frozen factors, merged models, the log history),
`resume` (the ProRL side of a checkpoint, restored), `callbacks` (HardResetCallback, SamplingScheduleCallback,
PlateauTracker), `state` (the trainer's own callback: pending resets, stop requests, phase plateau, checkpoint
state), `checks` (settings checked before init), `sampling` (where sampling settings live in TRL, and pushing new
ones there), `progress` (rate and ETA over the whole run), `dynamic_sampling`, `early_stop`, `kl_clamp` (verl's
bounded KL term), `overlong`, `finite` (stop before a NaN/inf update), `replay` (that step's batches kept and
replayed), `interrupt` (SIGINT/SIGTERM -> checkpoint and `RunInterrupted`), `on_demand` (`prorl-trl reset`: end the
phase at the next step on request), `trackers` (`report_to` trackers over a multi-phase run), `manifest` (what a run
creates in its output folder, recorded first: all that `--overwrite` deletes).

Names are imported on first use, so `prorl_trl.trainer.checks` (run by `prorl-trl validate`) does not import
`GRPOTrainer` and the model code behind it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .callbacks import HardResetCallback, PlateauTracker, SamplingScheduleCallback
    from .finite import NonFiniteGuard, NonFiniteUpdate
    from .interrupt import RunInterrupted, stop_on_signals
    from .trainer import ProRLTrainer

_HOME = {
    "HardResetCallback": "callbacks",
    "NonFiniteGuard": "finite",
    "NonFiniteUpdate": "finite",
    "PlateauTracker": "callbacks",
    "SamplingScheduleCallback": "callbacks",
    "ProRLTrainer": "trainer",
    "RunInterrupted": "interrupt",
    "stop_on_signals": "interrupt",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
