"""`GenerationArena`: one allocation for what the captured decode step reads that training never needs (issue 14).

Why: a CUDA graph replays at the addresses it captured, so its buffers cannot move between generations; yet the KV
buffers (1.6 GiB at the GSM8K recipe's Initial shape, 4.9 GiB at reset-4), the decode state and the folded base
weights (`decoder.FoldGroup`: the fold groups' base weights with copies of their adapters' A weights) are dead weight
while the trainer trains, and training is the memory peak. Held as views of one untyped storage, they are freed by
resizing that storage to nothing after a generation and allocated again before the next (as FSDP frees and re-makes
unsharded parameters): the views stay the same Python objects (the compiled step sees nothing new), only the address
may change, and when the allocator hands back another one the engine recaptures ("generation buffers moved").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

ALIGN = 512  # bytes between regions: the CUDA caching allocator's own alignment (vectorised loads, Triton's 16)


class Region(NamedTuple):
    """A named tensor of the arena: its shape and dtype (the arena's layout is the tuple of its regions)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class GenerationArena:
    """The regions as views (`views[name]`) of one allocation on `device`, made at construction, freed by `release`
    and made again by `acquire`; contents do not survive a release (whoever reads a region writes it first)."""

    def __init__(self, regions: Sequence[Region], device: torch.device | str):
        names = [region.name for region in regions]
        if len(set(names)) != len(names):
            raise ValueError(f"arena regions must have distinct names, got {names}")
        self.layout = tuple(regions)
        offsets, end = [], 0
        for region in self.layout:
            offsets.append(end)
            end += -(-region.nbytes // ALIGN) * ALIGN
        self.nbytes = max(end, ALIGN)
        self._bytes = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.views = {
            region.name: self._bytes[offset : offset + region.nbytes].view(region.dtype).view(region.shape)
            for region, offset in zip(self.layout, offsets, strict=True)
        }

    @property
    def held(self) -> bool:
        """The memory is allocated (between `acquire` and `release`)."""
        return self._bytes.untyped_storage().nbytes() > 0

    @property
    def address(self) -> int:
        """Where the memory starts (0 while released): a captured graph is valid only at the address it saw."""
        return self._bytes.untyped_storage().data_ptr() if self.held else 0

    def acquire(self) -> None:
        """Allocate the memory again after a `release` (uninitialised; the caching allocator picks the address)."""
        if not self.held:
            self._bytes.untyped_storage().resize_(self.nbytes)

    def release(self) -> None:
        """Give the memory back to the allocator (stream-ordered: work already queued that reads it still may)."""
        self._bytes.untyped_storage().resize_(0)
