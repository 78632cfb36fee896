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
from test_lora_decode import CASES, decode_step_on_random_cache, folded_groups, frozen_model


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


def joined_stacks(parts, dtype) -> list[tuple]:
    """(modules, fused with joined-up buffers filled by `refresh_joined`, joins) for every folded group of `parts`, the
    joins being each module's frozen parts (all of them, as `frozen_joins` plans them on CUDA)."""
    import dataclasses

    groups = []
    for modules, fused in folded_groups(parts):
        joins = tuple(tuple(lora_decode.frozen_factors(module)) for module in modules)
        buffers = tuple(
            torch.empty(base.weight.shape[0], sum(f.up.shape[1] for f in parts_), dtype=torch.float32)
            if len(parts_) >= 2 else None
            for base, parts_ in zip(fused.members, joins)
        )  # fmt: skip
        joined = dataclasses.replace(fused, joined_ups=buffers)
        lora_decode.refresh_joined(joined, [p if len(p) >= 2 else () for p in joins])
        groups.append((modules, joined, joins))
    return groups


@pytest.mark.parametrize("case", CASES, ids=str)
@torch.no_grad()
def test_joined_frozen_parts_are_the_parts_to_float32_rounding(case):
    """`JOIN_FROZEN`: a module's two frozen parts as one factor (ups side by side, scaled in float32) over the same
    A-product columns give the reference's bf16 outputs of the parts taken one by one, up to float32 rounding moving
    a bf16 rounding now and then; the live adapter stays its own factor, after them."""
    model = frozen_model(torch.bfloat16, **CASES[case])
    parts = decoder_parts(model)
    refresh_fusions(parts)
    generator = torch.Generator().manual_seed(12)
    joined_modules = 0
    for modules, fused, joins in joined_stacks(parts, torch.bfloat16):
        x = torch.randn(7, 1, modules[0].in_features, generator=generator).to(torch.bfloat16)
        stages = [lora_decode.stage_of(m, lora_decode.lora_factors(m, x)) for m in modules]
        product = lora_decode._float32_product(x.reshape(7, -1), fused.stacked)
        ranks = sum(f.down.shape[0] for stage in stages for f in stage)
        apart = lora_decode._epilogue_factors(fused.sizes, stages)
        together = lora_decode._epilogue_factors(fused.sizes, stages, fused.joined_ups)
        joined_here = sum(len(p) >= 2 for p in joins)
        assert len(together) == len(apart) - joined_here  # two parts -> one factor per joined module
        for buffer, module_parts in zip(fused.joined_ups, joins):
            if buffer is not None:
                want = torch.cat([f.up * f.scaling for f in module_parts], dim=1)
                assert torch.equal(buffer, want)
                joined_factor = next(f for f in together if f.up is buffer)
                assert joined_factor.scaling == 1.0
        args = (product, fused.bias, fused.weight.shape[0], ranks, fused.extra_rows > ranks, torch.bfloat16)
        one_by_one = epilogue_reference(args[0], args[1], apart, *args[2:])
        joined = epilogue_reference(args[0], args[1], together, *args[2:])
        differing = (one_by_one != joined).float().mean().item()
        assert differing < 0.02, differing
        torch.testing.assert_close(joined.float(), one_by_one.float(), atol=0.02, rtol=2**-7)
        joined_modules += joined_here
    assert joined_modules > 0


def test_frozen_parts_are_joined_only_where_the_kernel_will_run(monkeypatch):
    """`frozen_joins` plans a join only for groups bound for `lora_epilogue`'s kernel: none on CPU, none with
    `JOIN_FROZEN` or the kernel off; a module with one frozen part keeps it as it is."""
    model = frozen_model(torch.bfloat16, **CASES["q,k"])
    parts = decoder_parts(model)
    stacks = refresh_fusions(parts)
    assert stacks and all(stack.joins == () for stack in stacks)  # CPU: the kernel never runs here
    layer = parts.layers[0].self_attn
    modules = (layer.q_proj, layer.k_proj, layer.v_proj)
    adapted = lora_decode.fold_factors(modules)
    weight, sizes = layer.q_proj.base_layer.weight, [lora_decode.base_linear(m).weight.shape[0] for m in modules]
    assert lora_decode.frozen_joins(modules, adapted, sizes, weight) == ((), (), ())
    monkeypatch.setattr(lora_decode, "JOIN_FROZEN", False)
    assert lora_decode.frozen_joins(modules, adapted, sizes, weight) == ((), (), ())
    assert lora_decode._joined_count(adapted[:2], None) == 0
    wide = torch.zeros(adapted[0].up.shape[0], adapted[0].down.shape[0])  # one part's width: no join of one
    assert lora_decode._joined_count(adapted, wide) == 0


def check_kernel(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """The kernel against the reference on `device`; on CUDA also 20 graph replays, bit-identical. Under the CPU
    interpreter the products are TF32 x 3 (its bf16 conversions are wrong), on CUDA the default bf16 x 3."""
    from prorl_trl.rollout.fused_mlp import power_of_two
    from prorl_trl.rollout.lora_epilogue_triton import launch_epilogue

    generator = torch.Generator().manual_seed(1)
    precision = "tf32x3" if device == "cpu" else "bf16x3"
    for dtype in dtypes:
        for product, bias, factors, width, ranks, split in cases(device, generator):
            boundaries = sorted({*(f.start for f in factors), *(f.end for f in factors), width})
            spans = [(f.start, f.end, f.hidden_offset) for f in factors]

            def launch():
                return launch_epilogue(product, bias, [f.up for f in factors], [f.scaling for f in factors], spans,
                                       width, ranks, split, dtype, power_of_two(product.shape[0], 16, 64),
                                       column_block(boundaries), precision=precision)  # fmt: skip

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
@pytest.mark.parametrize("precision", ["bf16x3", "tf32x3", "ieee"])
def test_lora_deltas_keep_float32_precision_on_cuda(precision):
    """The reset-4 shape's o projection (64 rows, 896 columns, an r64 float32 adapter), zero base outputs so the
    outputs are the delta alone: the kernel's bf16 outputs equal the reference's (float32 products) except where a
    summation order moves a rounding, with three bf16 products of high and low parts (the default), three TF32
    products or IEEE; one TF32 product (10 mantissa bits) would move about a tenth of them."""
    from prorl_trl.rollout.lora_epilogue_triton import launch_epilogue

    generator = torch.Generator().manual_seed(3)
    rows, width, rank = 64, 896, 64
    product = torch.cat([torch.zeros(rows, width), torch.randn(rows, rank, generator=generator)], dim=1).cuda()
    up = (torch.randn(width, rank, generator=generator) * 0.1).cuda()
    factors = [EpilogueFactor(up, 2.0, 0, width, 0)]
    want = epilogue_reference(product, None, factors, width, rank, False, torch.bfloat16)
    got = launch_epilogue(product, None, [up], [2.0], [(0, width, 0)], width, rank, False, torch.bfloat16, 64, 32,
                          precision=precision)  # fmt: skip
    differing = (got != want).float().mean().item()
    assert differing < 0.01, differing

    def tf32(t: torch.Tensor) -> torch.Tensor:  # float32 cut to TF32's 10 mantissa bits
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)

    hidden = product[:, width:]
    one_tf32 = (((tf32(hidden) @ tf32(up).T) * 2.0).to(torch.bfloat16) != want).float().mean().item()
    assert one_tf32 > 5 * max(differing, 1e-4), (one_tf32, differing)  # the test could tell a coarser product apart


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@torch.no_grad()
def test_decode_step_with_joined_frozen_parts_on_cuda(monkeypatch):
    """A bf16 model after two frozen resets (q, k), every folded group on the kernel (`MIN_RANK` 1): the engine's
    stacks join q's and k's parts (the buffers hold the scaled ups), one decode step's logits with the join equal
    those with each part its own factor within bf16 rounding, and the step reads the joined buffers (zeroed, the
    frozen parts' share of q and k goes and the logits move)."""
    from prorl_trl.rollout import lora_epilogue

    monkeypatch.setattr(lora_epilogue, "MIN_RANK", 1)
    model = frozen_model(torch.bfloat16, **CASES["q,k"]).cuda()
    parts = decoder_parts(model)
    decode = decode_step_on_random_cache(parts, batch=16, columns=64, write_at=40, starts_below=10)

    def step(join: bool):
        monkeypatch.setattr(lora_decode, "JOIN_FROZEN", join)
        stacks = refresh_fusions(parts)
        return stacks, decode()

    stacks, joined = step(True)
    qkv = [stack for stack in stacks if stack.group == "fused_qkv"]
    assert qkv and all(len(stack.joins[0]) == len(stack.joins[1]) == 2 and not stack.joins[2] for stack in qkv)
    fused = parts.stacks[qkv[0].name]
    want = torch.cat([f.up * f.scaling for f in qkv[0].joins[0]], dim=1)
    assert torch.equal(fused.joined_ups[0], want) and fused.joined_ups[2] is None
    for stack in qkv:
        for buffer in parts.stacks[stack.name].joined_ups[:2]:
            buffer.zero_()
    without_parts = decode()
    error = ((without_parts - joined).norm() / joined.norm()).item()
    assert error > 1e-2, error  # the step read the joined buffers
    apart_stacks, apart = step(False)
    assert all(stack.joins == () for stack in apart_stacks)
    error = ((joined - apart).norm() / apart.norm()).item()
    assert error < 2e-2, error
