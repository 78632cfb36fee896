"""The generation arena (prorl_trl.rollout.arena): one allocation of named, aligned views that is freed after a
generation and made again before the next, the views staying the same objects."""

from __future__ import annotations

import pytest
import torch

from prorl_trl.rollout.arena import ALIGN, GenerationArena, Region

REGIONS = [
    Region("kv", (2, 3, 4, 5), torch.bfloat16, "kv"),
    Region("out", (3, 7), torch.long, "state"),
    Region("step", (), torch.long, "state"),
    Region("weight", (5, 6), torch.bfloat16, "kv"),
]


def test_regions_are_aligned_disjoint_views_of_one_allocation_per_buffer():
    arena = GenerationArena(REGIONS, "cpu")
    assert arena.held and arena.layout == tuple(REGIONS) and len(arena.address) == 2
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
