"""Programmatic dependent launch (PDL) for the engine's own Triton kernels.

Why: at the seed's Initial shape a decode step is ~288 short kernels (1.19 ms a step on an H200, 2026-11-30), so each
kernel's launch and ramp-up is a share of the step. Inductor's kernels already launch with PDL
(`engine.DEFAULT_COMPILE_OPTIONS`): a kernel starts while the previous one finishes and waits on the GPU
(`griddepcontrol.wait`) before it reads that kernel's results. Our kernels (attention, the fused MLP, the LoRA
epilogue, the sampler's) launched without it, so each started only once its predecessor had ended.

With `LAUNCH_PDL` each of them launches with PDL and, as its first action, waits for its predecessor, then lets its
own successor launch (`pdl_triton.enter`). Waiting first keeps every read and write after the predecessor's end, as
without PDL, so the results are the same; what overlaps is the launch. Kernels that let a successor launch only after
their own wait keep inductor's rule: a kernel may read, before its wait, what kernels two or more launches back
wrote, because by then they have ended.

Only on devices that have it (compute capability 9.0, Hopper, and later); read at each launch, so part of the engine's
capture key. False only for the A/B (generation.py's `rollout_engine_no_pdl`).
"""

from __future__ import annotations

import torch

LAUNCH_PDL = True
_CAPABLE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` should use PDL (`LAUNCH_PDL` and a device that supports it)."""
    if not LAUNCH_PDL or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]
