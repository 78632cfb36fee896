"""The device side of `pdl` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first action under PDL: wait until the previous kernel has ended and its writes are visible, then
    let the next kernel launch (it starts once every program of this one has passed here). Without PDL: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
