"""`GenerationArena`: the buffers the captured decode step reads that training never needs, held only while generating.

Why (issue 14): a CUDA graph replays at the addresses it captured, so its buffers cannot move between generations;
yet the KV buffers (1.6 GiB at the GSM8K recipe's Initial shape, 4.9 GiB at reset-4), the decode state, the sampler's
values, the attention kernel's counters and the stacked projections (`decoder.StackGroup`: copies of q/k/v's and
gate/up's base weights, and of o's and down's where adapted, with copies of their adapters' A weights) are dead
weight while the trainer trains, and training is the memory peak. Each buffer is one allocation (`Region.buffer`)
whose regions are views of it; the arena frees them by resizing their storage to nothing after a generation and
allocates them again before the next (as FSDP frees and re-makes unsharded parameters): the views stay the same
Python objects (the compiled step sees nothing new), only the addresses may change, and when they do the engine
recaptures ("generation buffers moved"). A buffer holds one dtype: AOT autograd refuses in-place writes to views whose
base has another dtype (one byte buffer for everything failed to compile).

Where the memory goes between generations (CUDA): not into the caching allocator's default pool. There training split
the freed 1.7 GiB KV segment for its own tensors (at the GSM8K recipe's reset-3, at the out-of-memory error: a 684 MiB
activation in it between 378 and 666 MiB of free space), so neither its next 684 MiB request fit there nor could the
allocator release it, and the step ran out of memory under a cap `compiled_generation` runs in (benchmarks/results/
rollout_engine.md, commits b602886 and 115e9bb, 2026-11-27). The buffers live in a `torch.cuda.MemPool` of their own,
made at each acquire and dropped at each release, which returns the memory to the driver; its allocator is
`fixed_addresses`' (CUDA virtual memory: the memory goes, the virtual addresses stay reserved and come back), so the
graph stays valid. Where that is unavailable the pool
allocates with `cudaMalloc`, whose addresses moved at every generation (a recapture each, ~0.2 s). Allocating may need
the memory training left cached: on an out-of-memory error the arena empties the allocator's cache once and tries
again (inside a private pool some torch versions do not do that themselves).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import fixed_addresses

ALIGN = 512  # bytes between regions: the CUDA caching allocator's own alignment (vectorised loads, Triton's 16)
PRIVATE_POOL = True  # A/B switch (benchmarks): False keeps the buffers in the caching allocator's default pool
FIXED_ADDRESSES = True  # A/B switch (benchmarks): False gives the private pool cudaMalloc'd memory (addresses move)


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
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # a memory pool belongs to one device
        self._pool: Any = None  # torch.cuda.MemPool while held on CUDA
        self.fixed_address_pool = False  # the pool maps memory at fixed addresses (`fixed_addresses`)
        self._buffers: dict[str, torch.Tensor] = {}
        self._allocate(lambda: self._buffers.update({name: torch.empty(max(size, 1), dtype=dtypes[name], device=device)
                                                     for name, size in offsets.items()}))  # fmt: skip
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

    @property
    def private_pool(self) -> bool:
        """The buffers are held in a memory pool of their own, returned to the driver at `release` (CUDA)."""
        return self._pool is not None

    def acquire(self) -> None:
        """Allocate the buffers again after a `release` (uninitialised; the allocator picks the addresses)."""
        if not self.held:
            self._allocate(self._resize_empty_storages)

    def release(self) -> None:
        """Free the buffers. On CUDA their pool is dropped, which returns its memory to the driver (unmapped from its
        fixed addresses, or `cudaFree`d), after the work queued on the device has finished."""
        if self._pool is not None:
            torch.cuda.synchronize(self.device)  # unmapped memory must not be in use (the generation has ended)
        for buffer in self._buffers.values():
            buffer.untyped_storage().resize_(0)
        self._pool = None  # MemPool's destructor empties the pool's cache: its segments go back to the driver

    def _resize_empty_storages(self) -> None:
        for buffer in self._buffers.values():
            storage = buffer.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buffer.numel() * buffer.element_size())

    def _allocate(self, allocate: Callable[[], None]) -> None:
        if self.device.type != "cuda" or not PRIVATE_POOL or not hasattr(torch.cuda, "use_mem_pool"):
            allocate()
            return
        with torch.cuda.device(self.device):
            if self._pool is None:
                fixed = fixed_addresses.allocator(self.device) if FIXED_ADDRESSES else None
                self._pool = torch.cuda.MemPool(fixed.torch_allocator) if fixed else torch.cuda.MemPool()
                self.fixed_address_pool = fixed is not None
            for attempt in range(2):
                try:
                    with torch.cuda.use_mem_pool(self._pool, self.device):
                        allocate()
                    return
                except torch.OutOfMemoryError:
                    if attempt:
                        raise
                    torch.cuda.empty_cache()  # what training left cached, then once more
