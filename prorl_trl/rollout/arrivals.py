"""Arrival counters of the split attention kernel (`decode_attention_triton`), kept apart so that the kernel module
and the engine both import them without importing each other.

The kernel's last program to arrive for a (row, kv head) merges the splits and sets its counter back to 0, so a CUDA
graph replays the launch without a memset; the engine lends counters from its generation arena, so that nothing of
the kernel stays allocated beside training.
"""

from __future__ import annotations

import torch

_ARRIVALS: dict[tuple[str, int], torch.Tensor] = {}  # per (device, count): zero between launches


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Arrival counters for the split kernel's last-to-arrive merge (`decode_attention_triton`), one tensor per device
    and size: lent by `lend_arrival_counters` (the rollout engine's generation arena), else allocated once and kept. A
    launch leaves them at 0, so a CUDA graph replays it without a memset; launches on one stream run one after
    another, so every split kernel shares them."""
    key = (str(device), count)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _ARRIVALS[key]


def lend_arrival_counters(counters: torch.Tensor) -> None:
    """Use `counters` (int32, zeros) for kernels of its size launched from now on: the engine's arena holds them only
    while it generates, so nothing of the kernel stays allocated beside training (512 B at the recipe's shapes, the
    engine's last byte over `compiled_generation`'s peak: commit 115e9bb, 2026-11-27)."""
    _ARRIVALS[(str(counters.device), counters.numel())] = counters


def withdraw_arrival_counters(counters: torch.Tensor) -> None:
    """Stop lending `counters` (before their memory is freed); a later launch of that size allocates its own."""
    key = (str(counters.device), counters.numel())
    if _ARRIVALS.get(key) is counters:
        del _ARRIVALS[key]
