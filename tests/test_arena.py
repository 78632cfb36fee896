"""The generation arena (prorl_trl.rollout.arena): one allocation of named, aligned views that is freed after a
generation and made again before the next, the views staying the same objects; on CUDA (skipped elsewhere) its memory
goes back to the driver, where training cannot split it, and comes back when training left it only cached."""

from __future__ import annotations

import pytest
import torch

from prorl_trl.rollout.arena import ALIGN, GenerationArena, Region
from prorl_trl.rollout.fixed_addresses import AddressBook

REGIONS = [
    Region("kv", (2, 3, 4, 5), torch.bfloat16, "kv"),
    Region("out", (3, 7), torch.long, "state"),
    Region("step", (), torch.long, "state"),
    Region("weight", (5, 6), torch.bfloat16, "kv"),
]


def test_regions_are_aligned_disjoint_views_of_one_allocation_per_buffer():
    arena = GenerationArena(REGIONS, "cpu")
    assert arena.held and arena.layout == tuple(REGIONS) and len(arena.address) == 2 and not arena.private_pool
    buffers = {"kv": arena.address[0], "state": arena.address[1]}
    for index, region in enumerate(REGIONS):
        view = arena.views[region.name]
        assert view.shape == region.shape and view.dtype == region.dtype and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == buffers[region.buffer]  # one allocation per buffer
        assert view._base is not None and view._base.dtype == view.dtype  # AOT autograd: no view across dtypes
        assert (view.data_ptr() - buffers[region.buffer]) % ALIGN == 0
        view.fill_(index + 1)
    for index, region in enumerate(REGIONS):  # no region overwrote another
        expected = torch.tensor(index + 1).to(region.dtype)
        assert bool((arena.views[region.name] == expected).all()), region.name
    assert arena.nbytes == 4 * ALIGN  # each region rounded up to the alignment, two per buffer


def test_release_frees_and_acquire_makes_the_same_views_again():
    arena = GenerationArena(REGIONS, "cpu")
    views = dict(arena.views)
    arena.release()
    assert not arena.held and arena.address == (0, 0)
    assert all(view.untyped_storage().nbytes() == 0 for view in views.values())  # every view's memory went
    arena.release()  # idempotent
    arena.acquire()
    assert arena.held and 0 not in arena.address
    assert all(arena.views[name] is view for name, view in views.items())  # same objects: a compiled step sees nothing new
    views["out"].fill_(7)
    assert bool((views["out"] == 7).all()) and views["out"].untyped_storage().data_ptr() == arena.address[1]
    arena.acquire()  # already held: nothing moves
    assert bool((views["out"] == 7).all())


def test_duplicate_names_and_mixed_dtypes_in_a_buffer_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        GenerationArena([Region("kv", (2,), torch.float32, "a"), Region("kv", (3,), torch.float32, "b")], "cpu")
    with pytest.raises(ValueError, match="one dtype per buffer"):
        GenerationArena([Region("kv", (2,), torch.bfloat16, "a"), Region("out", (3,), torch.long, "a")], "cpu")


def test_address_book_gives_each_request_the_range_it_had_before():
    """The arena asks for the same sizes in the same order at every acquire: each request must get back the range it
    had (the graph's addresses), ranges of another size or still mapped are not taken."""
    book = AddressBook()
    first, second, small = book.add(1 << 30, 4096), book.add(2 << 30, 4096), book.add(3 << 30, 512)
    assert book.take(4096) is first
    first.handle = 11
    assert book.take(4096) is second and book.take(512) is small and book.take(1024) is None
    second.handle, small.handle = 12, 13
    assert book.take(4096) is None  # both mapped: a new range would be reserved
    assert book.mapped_at(2 << 30) is second and book.mapped_at(5 << 30) is None
    first.handle = second.handle = small.handle = None  # released
    assert [book.take(4096), book.take(512)] == [first, small]  # the same ranges, in order, next time


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the caching allocator)")
MIB = 2**20


@needs_cuda
def test_on_cuda_release_gives_the_memory_to_the_driver_so_training_cannot_split_it():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    arena = GenerationArena([Region("kv", (128, MIB), torch.bfloat16, "kv"), Region("out", (64,), torch.long, "s")],
                            "cuda")  # fmt: skip
    assert arena.private_pool and arena.held
    held = torch.cuda.memory_reserved()
    arena.release()
    assert not arena.private_pool
    # in the default pool the freed 256 MiB would stay reserved (cached) and be split for the next smaller tensors
    assert torch.cuda.memory_reserved() <= held - 256 * MIB
    training = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")  # a tensor of the training step
    arena.acquire()
    assert arena.held and arena.private_pool
    kv = arena.views["kv"]
    assert not kv.data_ptr() <= training.data_ptr() < kv.data_ptr() + kv.numel() * kv.element_size()
    kv.fill_(3)
    assert int(kv[-1, -1]) == 3
    del training
    arena.release()


@needs_cuda
def test_on_cuda_acquire_takes_back_memory_training_left_cached():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    arena = GenerationArena([Region("kv", (256, MIB), torch.bfloat16, "kv")], "cuda")  # 512 MiB
    arena.release()
    cached = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    del cached  # freed by training, still reserved by the caching allocator's default pool
    total = torch.cuda.get_device_properties(0).total_memory
    # a cap that leaves room for the arena only if the cached 1 GiB is given up first
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MIB) / total)
    try:
        arena.acquire()
        assert arena.held  # the cached gigabyte went (the arena retries where the allocator does not free it itself)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        arena.release()


@needs_cuda
def test_on_cuda_the_memory_goes_to_the_driver_and_comes_back_at_the_same_addresses():
    """With CUDA's virtual memory management (`fixed_addresses`) the arena's memory leaves the process at a release
    (the driver's free memory grows by it) and comes back at the same addresses at the next acquire, however training
    allocated in between: a captured graph stays valid. Counted by the caching allocator as any other."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    arena = GenerationArena([Region("kv", (128, MIB), torch.bfloat16, "kv"), Region("out", (64,), torch.long, "s")],
                            "cuda")  # fmt: skip
    assert arena.fixed_address_pool, "virtual memory management unavailable: fixed_addresses.allocator gave None"
    address = arena.address
    assert torch.cuda.memory_allocated() >= 256 * MIB  # in the caching allocator's accounting
    arena.views["kv"].fill_(1)
    free_held = torch.cuda.mem_get_info()[0]
    arena.release()
    assert torch.cuda.mem_get_info()[0] >= free_held + 256 * MIB  # physical memory back to the driver
    training = [torch.empty(size * MIB, dtype=torch.uint8, device="cuda") for size in (300, 40, 256)]
    for _ in range(3):
        arena.acquire()
        assert arena.address == address
        kv = arena.views["kv"]
        kv.fill_(2)
        assert bool((kv == 2).all())
        arena.release()
    del training
