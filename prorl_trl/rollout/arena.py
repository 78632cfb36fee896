"""`GenerationArena`: the buffers the captured decode step reads that training never needs, held only while generating.

Why (issue 14): a CUDA graph replays at the addresses it captured, so its buffers cannot move between generations;
yet the KV buffers (1.6 GiB at the GSM8K recipe's Initial shape, 4.9 GiB at reset-4), the decode state's token
buffer and the folded base weights (`decoder.FoldGroup`: the fold groups' base weights with copies of their adapters'
A weights) are dead weight while the trainer trains, and training is the memory peak. Each buffer is one allocation
(`Region.buffer`) whose regions are views of it; the arena frees them by resizing their storage to nothing after a
generation and allocates them again before the next (as FSDP frees and re-makes unsharded parameters): the views stay
the same Python objects (the compiled step sees nothing new), only the addresses may change, and when the allocator
hands back another one the engine recaptures ("generation buffers moved"). A buffer holds one dtype: AOT autograd
refuses in-place writes to views whose base has another dtype (one byte buffer for everything failed to compile).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

ALIGN = 512  # bytes between regions: the CUDA caching allocator's own alignment (vectorised loads, Triton's 16)


class Region(NamedTuple):
    """A named tensor of the arena, a view of the allocation `buffer` (the arena's layout is the tuple of regions)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: str

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


class GenerationArena:
    """The regions as views (`views[name]`) of one allocation per `Region.buffer` on `device`, made at construction,
    freed by `release` and made again by `acquire`; contents do not survive a release (whoever reads a region writes
    it first)."""

    def __init__(self, regions: Sequence[Region], device: torch.device | str):
        names = [region.name for region in regions]
        if len(set(names)) != len(names):
            raise ValueError(f"arena regions must have distinct names, got {names}")
        self.layout = tuple(regions)
        dtypes: dict[str, torch.dtype] = {}
        offsets: dict[str, int] = {}
        starts = []
        for region in self.layout:
            if dtypes.setdefault(region.buffer, region.dtype) != region.dtype:
                raise ValueError(f"arena buffer {region.buffer!r} holds {dtypes[region.buffer]}; region "
                                 f"{region.name!r} is {region.dtype} (one dtype per buffer)")  # fmt: skip
            step = max(ALIGN // region.dtype.itemsize, 1)
            start = offsets.get(region.buffer, 0)
            starts.append(start)
            offsets[region.buffer] = start + -(-region.numel // step) * step
        self._buffers = {name: torch.empty(max(size, 1), dtype=dtypes[name], device=device)
                         for name, size in offsets.items()}  # fmt: skip
        self.views = {
            region.name: self._buffers[region.buffer][start : start + region.numel].view(region.shape)
            for region, start in zip(self.layout, starts, strict=True)
        }

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    @property
    def held(self) -> bool:
        """The memory is allocated (between `acquire` and `release`)."""
        return all(buffer.untyped_storage().nbytes() > 0 for buffer in self._buffers.values())

    @property
    def address(self) -> tuple[int, ...]:
        """Where each buffer starts (0 while released): a captured graph is valid only at the addresses it saw."""
        return tuple(buffer.untyped_storage().data_ptr() for buffer in self._buffers.values())

    def acquire(self) -> None:
        """Allocate the buffers again after a `release` (uninitialised; the caching allocator picks the addresses)."""
        for buffer in self._buffers.values():
            storage = buffer.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buffer.numel() * buffer.element_size())

    def release(self) -> None:
        """Give the memory back to the allocator (stream-ordered: work already queued that reads it still may)."""
        for buffer in self._buffers.values():
            buffer.untyped_storage().resize_(0)
