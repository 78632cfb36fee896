"""`prorl_trl.rollout.lora_epilogue`: a folded group's B products, additions and rounding as one kernel.

On CPU: the torch reference is bit for bit what `lora_decode._folded` computes from the same GEMM (real PEFT adapters
with frozen parts of earlier resets, bf16 base), and an independent per-module formula. The kernel under Triton's CPU
interpreter where Triton is installed (float16: Triton 3.6's interpreter rounds to bf16 wrongly), and on CUDA: against
the reference (several modules, frozen and live factors, ranks below a block, bias, split A rows, rows over one tile),
reproducible launches and graph replays, and the float32 precision of its TF32 x 3 products. Where the kernel sits
in the decode step: test_rollout_engine_gpu (a bf16 step with the switch on and off).
"""

from __future__ import annotations

import pytest
import torch

from prorl_trl.rollout import lora_decode
from prorl_trl.rollout.decode_attention import triton_available
from prorl_trl.rollout.decoder import decoder_parts, refresh_fusions
from prorl_trl.rollout.lora_epilogue import EpilogueFactor, applies, column_block, epilogue_reference, takes_kernel
from test_fused_mlp import assert_graph_replays_equal
from test_lora_decode import CASES, folded_groups, frozen_model


@pytest.mark.parametrize("case", CASES, ids=str)
@torch.no_grad()
def test_reference_is_the_folded_path_bit_for_bit(case):
    """bf16 model, float32 adapters after two frozen resets: for every folded group the reference's outputs equal
    `_folded`'s (the torch path the kernel replaces) exactly."""
    model = frozen_model(torch.bfloat16, **CASES[case])
    parts = decoder_parts(model)
    refresh_fusions(parts)
    generator = torch.Generator().manual_seed(11)
    checked = 0
    for modules, fused in folded_groups(parts):
        x = torch.randn(5, 1, modules[0].in_features, generator=generator).to(torch.bfloat16)
        stages = [lora_decode.stage_of(m, lora_decode.lora_factors(m, x)) for m in modules]
        want = lora_decode._folded(x, fused, stages)
        product = lora_decode._float32_product(x.reshape(5, -1), fused.stacked)
        ranks = sum(f.down.shape[0] for stage in stages for f in stage)
        factors = lora_decode._epilogue_factors(fused.sizes, stages)
        assert len(factors) == sum(len(stage) for stage in stages) > 0
        ours = epilogue_reference(product, fused.bias, factors, fused.weight.shape[0], ranks,
                                  fused.extra_rows > ranks, torch.bfloat16)  # fmt: skip
        for got, expected in zip(ours.split(fused.sizes, dim=-1), want, strict=True):
            assert torch.equal(got, expected.reshape(5, -1))
        checked += 1
    assert checked > 0


def independent(product, bias, factors, width, ranks, split, dtype):
    """Module by module, element formulas in float64 of the same float32 values, rounded as PEFT rounds: base to
    `dtype`, the factors added in float32, one rounding."""
    hidden = product[:, width : width + ranks].double()
    if split:
        hidden = (product[:, width : width + ranks] + product[:, width + ranks :]).double()
    base = product[:, :width] + (bias.float() if bias is not None else 0)
    out = base.to(dtype).float()
    for factor in factors:
        part = hidden[:, factor.hidden_offset : factor.hidden_offset + factor.up.shape[1]]
        delta = (part @ factor.up.double().T).float() * factor.scaling
        out[:, factor.start : factor.end] += delta
    return out.to(dtype)


def cases(device: str, generator: torch.Generator):
    """(product, bias, factors, width, ranks, split): q/k/v-like groups with a frozen and a live factor, a module
    without adapter, ranks below a block, odd rows."""
    # module sizes, factors as (module index, rank, scaling), rows, split, bias
    layouts = [((64, 32, 32), [(0, 8, 2.0), (0, 4, 0.5), (1, 8, 2.0), (1, 4, 0.5)], 5, True, True),
               ((96,), [(0, 16, 1.0), (0, 64, 0.25)], 70, False, False),
               ((128, 32, 32), [(0, 32, 2.0), (1, 32, 2.0), (2, 20, 3.0)], 32, True, False),
               ((896, 128, 128), [(0, 32, 2.0), (0, 64, 1.0), (1, 32, 2.0), (1, 64, 1.0), (2, 64, 1.0)], 64, True,
                True)]  # fmt: skip
    for sizes, specs, rows, split, has_bias in layouts:
        if device == "cpu" and sum(sizes) > 200:
            continue  # the interpreter is slow; the model-sized case runs on CUDA
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        width, ranks = sum(sizes), sum(rank for _, rank, _ in specs)
        product = torch.randn(rows, width + ranks * (2 if split else 1), generator=generator)
        if split:
            product[:, width + ranks :] *= 2.0**-9  # the low parts: small, as A's remainders are
        factors, offset = [], 0
        for module, rank, scaling in specs:
            up = torch.randn(sizes[module], rank, generator=generator) * 0.1
            end = starts[module] + sizes[module]
            factors.append(EpilogueFactor(up.to(device), scaling, starts[module], end, offset))
            offset += rank
        bias = torch.randn(width, generator=generator).to(torch.bfloat16).to(device) if has_bias else None
        yield product.to(device), bias, factors, width, ranks, split


def test_the_kernel_is_taken_by_groups_with_an_adapter_of_rank_64_or_more():
    """The measured rule (`MIN_RANK`): the recipe's reset-4 groups (r64, behind r32 frozen parts) take the kernel, its
    r32 q,k groups (with or without frozen parts) keep the reductions; on CPU nothing takes it."""
    def group(*ranks):
        return [EpilogueFactor(torch.zeros(128, rank), 2.0, 0, 128, 0) for rank in ranks]

    assert takes_kernel(group(32, 32, 32, 32, 64)) and takes_kernel(group(64)) and takes_kernel(group(128))
    assert not takes_kernel(group(32)) and not takes_kernel(group(32, 32, 32, 32)) and not takes_kernel([])
    assert not applies(torch.zeros(64, 128 + 64), torch.bfloat16, group(64))  # a CPU tensor


def test_reference_matches_an_independent_formula():
    generator = torch.Generator().manual_seed(0)
    for args in cases("cpu", generator):
        ours, theirs = epilogue_reference(*args, torch.bfloat16), independent(*args, torch.bfloat16)
        differing = (ours != theirs).float().mean().item()
        assert differing < 0.02, differing  # float32 vs float64 products move a bf16 rounding now and then
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.02, rtol=2**-7)
    assert column_block((64, 96, 128)) == 32 and column_block((896, 1024, 1152)) == 32
    assert column_block((48, 64)) == 16 and column_block((40, 64)) is None


def check_kernel(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """The kernel against the reference on `device`; on CUDA also 20 graph replays, bit-identical."""
    from prorl_trl.rollout.fused_mlp import power_of_two
    from prorl_trl.rollout.lora_epilogue_triton import launch_epilogue

    generator = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for product, bias, factors, width, ranks, split in cases(device, generator):
            boundaries = sorted({*(f.start for f in factors), *(f.end for f in factors), width})
            spans = [(f.start, f.end, f.hidden_offset) for f in factors]

            def launch():
                return launch_epilogue(product, bias, [f.up for f in factors], [f.scaling for f in factors], spans,
                                       width, ranks, split, dtype, power_of_two(product.shape[0], 16, 64),
                                       column_block(boundaries))  # fmt: skip

            first = launch()
            assert torch.equal(launch(), first), "not reproducible"
            want = epilogue_reference(product, bias, factors, width, ranks, split, dtype)
            assert first.dtype == want.dtype == dtype and first.shape == want.shape
            differing = (first != want).float().mean().item()
            assert differing < 0.02, differing  # a summation order moves a 16-bit rounding now and then
            torch.testing.assert_close(first.float(), want.float(), atol=0.02, rtol=2**-6)
            if device == "cuda":
                assert_graph_replays_equal(launch, first)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (CPU torch); runs on the GPU machine")
def test_kernel_matches_reference_in_triton_interpreter():
    from test_rollout_engine import run_check_in_triton_interpreter

    run_check_in_triton_interpreter("test_lora_epilogue", "check_kernel('cpu', (torch.float16,))")  # bf16: CUDA only


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_kernel_matches_reference_on_cuda_and_replays_from_a_graph():
    check_kernel("cuda", (torch.bfloat16, torch.float16))


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("tf32x3", [True, False])
def test_lora_deltas_keep_float32_precision_on_cuda(tf32x3):
    """The reset-4 shape's o projection (64 rows, 896 columns, an r64 float32 adapter), zero base outputs so the
    outputs are the delta alone: the kernel's bf16 outputs equal the reference's (float32 products) except where a
    summation order moves a rounding, with TF32 x 3 products (the default) or IEEE; one TF32 product (10 mantissa
    bits) would move about a tenth of them."""
    from prorl_trl.rollout.lora_epilogue_triton import launch_epilogue

    generator = torch.Generator().manual_seed(3)
    rows, width, rank = 64, 896, 64
    product = torch.cat([torch.zeros(rows, width), torch.randn(rows, rank, generator=generator)], dim=1).cuda()
    up = (torch.randn(width, rank, generator=generator) * 0.1).cuda()
    factors = [EpilogueFactor(up, 2.0, 0, width, 0)]
    want = epilogue_reference(product, None, factors, width, rank, False, torch.bfloat16)
    got = launch_epilogue(product, None, [up], [2.0], [(0, width, 0)], width, rank, False, torch.bfloat16, 64, 32,
                          tf32x3=tf32x3)  # fmt: skip
    differing = (got != want).float().mean().item()
    assert differing < 0.01, differing

    def tf32(t: torch.Tensor) -> torch.Tensor:  # float32 cut to TF32's 10 mantissa bits
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)

    hidden = product[:, width:]
    one_tf32 = (((tf32(hidden) @ tf32(up).T) * 2.0).to(torch.bfloat16) != want).float().mean().item()
    assert one_tf32 > 5 * max(differing, 1e-4), (one_tf32, differing)  # the test could tell a coarser product apart
