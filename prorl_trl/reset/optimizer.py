"""The optimizer side of a hard reset: fresh Adam moments and step counts, same Parameters and param groups."""

from __future__ import annotations

import torch


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget Adam moments and step counts; param groups (and their Parameter objects and lr) are kept.

    Works on a plain optimizer and on accelerate's `AcceleratedOptimizer` (whose `.state` is the wrapped one's).
    The state is re-created lazily by the next `step()`, exactly as for a new optimizer.
    """
    inner = optimizer
    while hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):
        inner = inner.optimizer
    inner.state.clear()

