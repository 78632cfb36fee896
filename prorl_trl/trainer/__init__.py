"""`ProRLTrainer` and its callbacks: phases, sampling propagation, loop overrides (dynamic sampling, minibatch early
stop), when to hard-reset, and the overlong penalty.

Modules: `trainer` (ProRLTrainer), `callbacks` (HardResetCallback, SamplingScheduleCallback, PlateauTracker),
`state` (the trainer's own callback: pending resets, phase plateau, checkpoint state), `checks` (settings checked
before init), `sampling` (where sampling settings live in TRL), `dynamic_sampling`, `early_stop`, `overlong`.
"""

from .callbacks import HardResetCallback, PlateauTracker, SamplingScheduleCallback
from .trainer import ProRLTrainer

__all__ = ["HardResetCallback", "PlateauTracker", "ProRLTrainer", "SamplingScheduleCallback"]
