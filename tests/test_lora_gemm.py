"""`prorl_trl.rollout.lora_gemm`: the LoRA-product kernel's tiling, and the kernel against its torch reference.

The tiling on CPU; the kernel under Triton's CPU interpreter where Triton is installed (not in CI: the CPU torch does
not bring it) and on CUDA (the device machine): ragged shapes, K split several ways (the last-arriving split sums the
partials), PEFT's epilogue with a strided base, a second launch and graph replays bit-identical to the first (the
arrival counters are back at 0). Where the path sits in the decode step is tested in test_lora_decode (CPU) and
test_rollout_engine_gpu (graphs).
"""

from __future__ import annotations

import math

import pytest
import torch

from prorl_trl.rollout.decode_attention import triton_available
from prorl_trl.rollout.lora_gemm import MIN_SLICES_PER_SPLIT, TARGET_PROGRAMS, lora_product_reference, tile_layout

# (rows, outputs, depth): the seed's reset-4 products at 64 rows with r64 on all linear layers of Qwen2-0.5B (A of
# q/k/v together, A of down_proj, B of gate_proj), the Initial phase's q,k at 32 rows, and ragged ones
SHAPES = [(64, 192, 896), (64, 64, 4864), (64, 4864, 64), (32, 64, 896), (32, 896, 32), (5, 40, 300), (70, 33, 20)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tile_layout_covers_k_without_empty_splits(shape):
    rows, outputs, depth = shape
    block_m, block_n, block_k, split = tile_layout(rows, outputs, depth)
    assert block_m in (16, 32, 64) and block_m >= min(rows, 64) and block_k in (16, 32, 64) and block_n >= 16
    assert split % block_k == 0
    splits = math.ceil(depth / split)
    assert (splits - 1) * split < depth <= splits * split  # every split has columns to sum
    tiles = math.ceil(rows / block_m) * math.ceil(outputs / block_n)
    assert splits == 1 or tiles * splits <= 2 * TARGET_PROGRAMS  # split only up to about the target
    if depth > block_k * MIN_SLICES_PER_SPLIT and tiles < TARGET_PROGRAMS // 4:
        assert splits > 1, "few tiles and a long K: K must be split for enough programs"
    if depth >= block_k * MIN_SLICES_PER_SPLIT:
        assert split >= block_k * MIN_SLICES_PER_SPLIT, "thin splits make the merge the long pole"


def test_reference_is_pefts_function():
    """`base + (x @ W.T) * scaling` in float32, cast to the base's dtype: PEFT's `result + lora_B(h) * scaling`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=generator)
    up = torch.nn.Linear(16, 10, bias=False)
    base = torch.randn(6, 10, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        expected = (base + up(x) * 0.75).to(torch.bfloat16)
    assert torch.equal(lora_product_reference(x, up.weight, base, 0.75), expected)
    assert lora_product_reference(x.to(torch.bfloat16), up.weight).dtype == torch.float32


def check_kernel(device: str) -> None:
    """The kernel against the reference on `device`: reproducible, within float32 rounding (16-bit outputs: of one
    ulp), and on CUDA replayed 20 times from one CUDA graph bit-identically."""
    from prorl_trl.rollout.lora_gemm_triton import launch_lora_product

    generator = torch.Generator().manual_seed(0)
    cases = [
        (64, 4864, 64, torch.bfloat16, True, None), (64, 192, 896, torch.bfloat16, False, None),
        (64, 64, 4864, torch.float32, False, None), (5, 40, 300, torch.bfloat16, False, None),
        (70, 33, 20, torch.float16, True, None), (64, 48, 256, torch.bfloat16, True, (64, 32, 64, 64)),
    ]  # fmt: skip
    for rows, outputs, depth, dtype, with_base, layout in cases:
        x = torch.randn(rows, depth + 7, generator=generator).to(dtype).to(device)[:, 3 : 3 + depth]  # strided rows
        weight = (torch.randn(outputs, depth, generator=generator) * 0.05).to(device)
        fused = torch.randn(rows, 2 * outputs, generator=generator).to(dtype).to(device)
        base = fused[:, outputs:] if with_base else None  # a view of a fused projection's output
        layout = layout or tile_layout(rows, outputs, depth)
        first = launch_lora_product(x, weight, base, 0.5, layout)
        assert torch.equal(launch_lora_product(x, weight, base, 0.5, layout), first), "not reproducible"
        want = lora_product_reference(x, weight, base, 0.5)
        assert first.dtype == want.dtype and first.shape == want.shape
        tolerance = dict(atol=1e-5, rtol=1e-5) if first.dtype == torch.float32 else dict(atol=1e-3, rtol=2**-7)
        torch.testing.assert_close(first, want, **tolerance)
        if device == "cuda":
            static = torch.empty_like(first)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static.copy_(launch_lora_product(x, weight, base, 0.5, layout))
            for _ in range(20):
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static, first), "a graph replay differs: the arrival counters were not reset"


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (CPU torch); runs on the GPU machine")
def test_kernel_matches_reference_in_triton_interpreter():
    from test_rollout_engine import run_check_in_triton_interpreter

    run_check_in_triton_interpreter("test_lora_gemm", "check_kernel('cpu')")


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_kernel_matches_reference_on_cuda_and_replays_from_a_graph():
    check_kernel("cuda")
