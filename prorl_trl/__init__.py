"""prorl-trl: prolonged RL (ProRL) post-training as a drop-in extension of TRL's `GRPOTrainer`.

Public names are imported lazily, so `import prorl_trl.tiny` or the CLI's `validate` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "ProRLConfig": "prorl_trl.config",
    "PhaseConfig": "prorl_trl.config",
    "resolve_phases": "prorl_trl.config",
    "ProRLTrainer": "prorl_trl.trainer",
    "HardResetCallback": "prorl_trl.trainer.callbacks",
    "SamplingScheduleCallback": "prorl_trl.trainer.callbacks",
    "ValidationCallback": "prorl_trl.evaluation.validation",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .trainer.callbacks import HardResetCallback, SamplingScheduleCallback
    from .config import PhaseConfig, ProRLConfig, resolve_phases
    from .evaluation.validation import ValidationCallback
    from .trainer import ProRLTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prorl_trl' has no attribute {name!r}")
