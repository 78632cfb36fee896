"""`prorl_trl.rollout.lora_gemm`: the LoRA-product kernel's tiling, and the kernel against its torch reference; the
same kernel as `skinny_gemm.linear` runs it for 16-bit base projections, against `F.linear`'s function.

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


def check_base_projection(device: str, dtype: torch.dtype) -> None:
    """The same kernel as `skinny_gemm.linear` runs it: 16-bit weights (tensor cores), a bias, K split or not; equal to
    `F.linear`'s function (float32 accumulation, bias added, rounded once) within one ulp; on CUDA graph replays."""
    from prorl_trl.rollout.lora_gemm_triton import launch_lora_product

    generator = torch.Generator().manual_seed(1)
    cases = [(32, 96, 1000, True, None), (5, 40, 300, False, None), (32, 64, 512, True, (32, 32, 64, 128))]
    if device == "cuda":  # Qwen2-0.5B's projections at the Initial shape: q/k/v (bias), o, gate/up, down
        cases += [(32, 1152, 896, True, None), (32, 896, 896, False, None), (32, 9728, 896, False, None),
                  (32, 896, 4864, False, None), (64, 896, 4864, False, None)]  # fmt: skip
    for rows, outputs, depth, with_bias, layout in cases:
        x = torch.randn(rows, depth, generator=generator).to(dtype).to(device)
        weight = (torch.randn(outputs, depth, generator=generator) * depth**-0.5).to(dtype).to(device)
        bias = (torch.randn(outputs, generator=generator) * 0.1).to(dtype).to(device) if with_bias else None
        layout = layout or tile_layout(rows, outputs, depth)
        got = launch_lora_product(x, weight, None, 1.0, layout, bias=bias, out_dtype=dtype)
        assert torch.equal(launch_lora_product(x, weight, None, 1.0, layout, bias=bias, out_dtype=dtype), got)
        want = x.float() @ weight.float().T + (0 if bias is None else bias.float())
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-3, rtol=2**-7)
        if device == "cuda":
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-3, rtol=2**-7)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (CPU torch); runs on the GPU machine")
def test_kernel_matches_reference_in_triton_interpreter():
    from test_rollout_engine import run_check_in_triton_interpreter

    run_check_in_triton_interpreter(  # bf16 products are wrong in Triton 3.6's interpreter: fp16 stands in for them
        "test_lora_gemm", "check_kernel('cpu'); check_base_projection('cpu', torch.float16)"
    )


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_kernel_matches_reference_on_cuda_and_replays_from_a_graph():
    check_kernel("cuda")
    check_base_projection("cuda", torch.bfloat16)


def test_skinny_linear_applies_to_decode_steps_only(monkeypatch):
    """`skinny_gemm.applies`: switched on, 16-bit weights with inputs of their dtype, at most `MAX_ROWS` rows; and
    `linear` is `F.linear` wherever the kernel does not run (here, the CPU)."""
    from prorl_trl.rollout import skinny_gemm

    weight, bias = torch.randn(12, 8).to(torch.bfloat16), torch.randn(12).to(torch.bfloat16)
    x = torch.randn(5, 1, 8).to(torch.bfloat16)
    assert not skinny_gemm.applies(x, weight)  # off by default
    monkeypatch.setattr(skinny_gemm, "SKINNY_BASE", True)
    assert skinny_gemm.applies(x, weight)
    assert not skinny_gemm.applies(x.float(), weight.float())  # float32: cuBLAS
    assert not skinny_gemm.applies(torch.randn(65, 8).to(torch.bfloat16), weight)  # a prefill-sized input
    assert torch.equal(skinny_gemm.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
