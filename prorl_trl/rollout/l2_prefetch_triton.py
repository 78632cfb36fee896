"""Triton kernel of `l2_prefetch` (imported only where Triton is installed).

`programs` programs stride over a tensor's 128-byte lines, `BLOCK` lines an iteration, each line one PTX
`prefetch.global.L2::evict_last` (Ampere on): the line is fetched into L2 and kept there ahead of lines loaded with
the default priority; no register receives data and nothing is stored. A line past the end is clamped to the last
one (a repeated prefetch), so no address outside the tensor is touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # lines per program and iteration (8 per thread at 4 warps)


@triton.jit
def _prefetch_kernel(Base, lines, LINE: tl.constexpr, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    for iteration in range(ITERATIONS):
        line = (iteration * programs + program) * BLOCK + tl.arange(0, BLOCK)
        line = tl.minimum(line, lines - 1).to(tl.int64)
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [Base + line * LINE],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def launch_prefetch(tensor: torch.Tensor, programs: int, line_bytes: int = 128) -> None:
    """Prefetch `tensor`'s bytes (contiguous) into L2 on the current stream."""
    size = tensor.element_size()
    if line_bytes % size:
        raise ValueError(f"an L2 line of {line_bytes} bytes is not a whole number of {tensor.dtype} elements")
    lines = triton.cdiv(tensor.numel() * size, line_bytes)
    programs = max(1, min(programs, triton.cdiv(lines, BLOCK)))
    iterations = triton.cdiv(lines, programs * BLOCK)
    _prefetch_kernel[(programs,)](tensor, lines, LINE=line_bytes // size, BLOCK=BLOCK, ITERATIONS=iterations,
                                  num_warps=4)  # fmt: skip
