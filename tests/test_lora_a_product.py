"""`prorl_trl.rollout.lora_a_product`: gate/up's LoRA A products from their folded rows, as one kernel.

On CPU: the reference over folded rows (`refresh_folded`'s high and low rows) is PEFT's `lora_A(x)` of real adapters
(gate and up of a bf16 model) to the fold's precision, and the folded GEMM's A products to float32 rounding; the rule
(`folds`). On CUDA, the plan (`mlp_fold_factors`: only where the kernel will run, never on CPU, with frozen parts,
float32 weights, the switch or `fused_mlp`'s kernel off). The kernel under Triton's CPU interpreter where Triton is
installed, and on CUDA: against the reference (split and unsplit rows, ranks below and over a block, rows over a
tile, a strided input), reproducible launches and graph replays, its precision against float64, and a decode step of
a model with adapters on every linear layer, which folds gate/up, calls the kernel once a layer and gives the logits
of the reductions within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from prorl_trl.rollout import fused_mlp, lora_a_product, lora_decode
from prorl_trl.rollout.decode_attention import triton_available
from prorl_trl.rollout.decoder import decoder_parts, plan_fusions, refresh_fusions
from prorl_trl.rollout.fused_weights import stack_copies
from prorl_trl.rollout.lora_a_product import a_product_reference, folds
from test_fused_mlp import assert_graph_replays_equal
from test_lora_decode import adapted_model, decode_step_on_random_cache, frozen_model

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")


def folded_gate_up(model):
    """Layer 0's gate/up stacked with their adapters' A weights folded as extra rows (the engine's layout, on the
    model's device whatever the rule says): `(fused, adapted, normed input rows)`."""
    mlp = model.base_model.model.model.layers[0].mlp
    modules = (mlp.gate_proj, mlp.up_proj)
    adapted = lora_decode.fold_factors(modules)
    bases = [lora_decode.base_linear(module) for module in modules]
    weight = bases[0].weight
    rows = sum(base.weight.shape[0] for base in bases) + lora_decode.fold_rows(adapted, weight.dtype)
    fused = stack_copies(bases, torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device), None)
    lora_decode.refresh_folded(fused, adapted)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(7, weight.shape[1], generator=generator).to(weight.dtype).to(weight.device)
    return fused, adapted, x


@torch.no_grad()
def test_reference_over_folded_rows_is_peft_lora_a_of_gate_and_up():
    """bf16 model, float32 adapters on every linear layer (up of another rank): the reference over the high and low
    rows is gate's and up's PEFT `lora_A(x)` to the fold's ~16 mantissa bits of A, and the A products of the folded
    GEMM (`_folded`'s `high + low`) to float32 rounding."""
    model = adapted_model(torch.bfloat16, target_modules="all-linear", rank_pattern={"up_proj": 8})
    for name, param in model.named_parameters():
        if "lora_A" in name:  # float32 values bf16 cannot hold (PEFT initialised them in the base dtype)
            torch.nn.init.normal_(param, std=0.1)
    fused, adapted, x = folded_gate_up(model)
    ranks = sum(factor.down.shape[0] for factor in adapted)
    assert [factor.down.shape[0] for factor in adapted] == [4, 8] and fused.extra_rows == 2 * ranks
    got = a_product_reference(x, fused.extra, ranks)
    mlp = model.base_model.model.model.layers[0].mlp
    want = torch.cat([mlp.gate_proj.lora_A["default"](x.float()), mlp.up_proj.lora_A["default"](x.float())], dim=1)
    torch.testing.assert_close(got, want, rtol=2**-14, atol=1e-5)
    assert not torch.equal(got, a_product_reference(x, fused.extra[:ranks], ranks))  # the low rows count
    product = lora_decode._float32_product(x, fused.stacked)
    width = fused.weight.shape[0]
    torch.testing.assert_close(got, product[:, width : width + ranks] + product[:, width + ranks :], rtol=1e-6,
                               atol=1e-6)  # fmt: skip


def test_the_rule_folds_16_bit_weights_with_float32_adapters_on_cuda(monkeypatch):
    monkeypatch.setattr(lora_a_product, "triton_available", lambda: True)  # the rule alone, whatever is installed
    assert folds(True, torch.bfloat16, [torch.float32, torch.float32]) and folds(True, torch.float16, [torch.float32])
    assert not folds(False, torch.bfloat16, [torch.float32])  # CPU
    assert not folds(True, torch.float32, [torch.float32])  # float32 models keep the reductions
    assert not folds(True, torch.bfloat16, [torch.float32, torch.bfloat16])
    assert not folds(True, torch.bfloat16, [])
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", False)
    assert not folds(True, torch.bfloat16, [torch.float32])
    monkeypatch.setattr(lora_a_product, "triton_available", lambda: False)
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", True)
    assert not folds(True, torch.bfloat16, [torch.float32])


def gate_up_extra_rows(model) -> list[int]:
    return [stack.extra_rows for stack in plan_fusions(decoder_parts(model)) if stack.group == "fused_gate_up"]


@CUDA
def test_gate_up_fold_only_where_the_kernel_runs(monkeypatch):
    """The plan folds gate/up's A rows where `folds` holds and `fused_mlp`'s kernel will take the MLP: not on CPU, not
    with the switch or the fused MLP off, never with frozen parts on gate/up (that MLP runs `project`)."""
    model = adapted_model(torch.bfloat16, target_modules="all-linear")
    layers = len(decoder_parts(model).layers)
    assert gate_up_extra_rows(model) == [0] * layers  # CPU: no Triton kernel
    model.cuda()
    assert gate_up_extra_rows(model) == [2 * 2 * 4] * layers  # high and low rows of two r4 adapters
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", False)
    assert gate_up_extra_rows(model) == [0] * layers
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", True)
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", False)
    assert gate_up_extra_rows(model) == [0] * layers
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", True)
    assert gate_up_extra_rows(frozen_model(torch.bfloat16, target_modules="all-linear").cuda()) == [0] * layers
    assert gate_up_extra_rows(model.float()) == [0] * layers  # float32 weights


def cases(device: str, dtype: torch.dtype, generator: torch.Generator):
    """(input rows, folded A rows, ranks, tiles): the reset-4 gate/up shape (high and low rows of two r64 adapters),
    ranks no multiple of the block, rows over one tile, unsplit rows."""
    shapes = [(64, 896, 128, True, (16, 32, 128)), (5, 100, 35, True, (16, 16, 64)), (40, 96, 32, False, (32, 32, 32)),
              (3, 40, 21, True, (16, 16, 16))]  # fmt: skip
    for rows, features, ranks, split, tiles in shapes:
        x = torch.randn(rows, features, generator=generator).to(dtype).to(device)
        a = torch.randn(ranks, features, generator=generator) * 0.05
        high = a.to(dtype)
        a_rows = torch.cat([high, (a - high.float()).to(dtype)]) if split else high
        yield x, a_rows.to(device), ranks, tiles


def check_kernel(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """The kernel against the reference on `device` (also a strided input); on CUDA also 20 graph replays, each
    bit-identical to the first launch."""
    from prorl_trl.rollout.lora_a_product_triton import launch_a_product

    generator = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for x, a_rows, ranks, (block_m, block_r, block_k) in cases(device, dtype, generator):
            for rows in (x, torch.cat([x, x], dim=1)[:, ::2]):

                def launch():
                    return launch_a_product(rows, a_rows, ranks, block_m, block_r, block_k)

                first = launch()
                assert torch.equal(launch(), first), "not reproducible"
                want = a_product_reference(rows, a_rows, ranks)
                assert first.dtype == torch.float32 and first.shape == want.shape == (x.shape[0], ranks)
                torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
                if device == "cuda":
                    assert_graph_replays_equal(launch, first)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (CPU torch); runs on the GPU machine")
def test_kernel_matches_reference_in_triton_interpreter():
    from test_rollout_engine import run_check_in_triton_interpreter

    run_check_in_triton_interpreter("test_lora_a_product", "check_kernel('cpu', (torch.float16,))")  # bf16: CUDA only


@CUDA
def test_kernel_matches_reference_on_cuda_and_replays_from_a_graph():
    check_kernel("cuda", (torch.bfloat16, torch.float16))


@CUDA
def test_products_keep_the_folds_precision_on_cuda():
    """The reset-4 gate/up shape: the kernel's products are as close to float64 as the reference's (within a factor
    of 2), where the high rows alone (A in bf16) are over 20 times further."""
    from prorl_trl.rollout.lora_a_product_triton import launch_a_product

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 896, generator=generator).to(torch.bfloat16).cuda()
    a = (torch.randn(128, 896, generator=generator) * 0.05).cuda()
    high = a.to(torch.bfloat16)
    a_rows = torch.cat([high, (a - high.float()).to(torch.bfloat16)])
    exact = x.double() @ a.double().T

    def error(t: torch.Tensor) -> float:
        return ((t.double() - exact).norm() / exact.norm()).item()

    got = launch_a_product(x, a_rows, 128, 16, 32, 128)
    assert error(got) < 2 * error(a_product_reference(x, a_rows, 128)) + 1e-9
    assert error(launch_a_product(x, high, 128, 16, 32, 128)) > 20 * error(got)


@CUDA
@torch.no_grad()
def test_decode_step_takes_the_kernel_for_gate_and_up_on_cuda(monkeypatch):
    """A bf16 model with float32 adapters on every linear layer: gate/up fold their A rows, one decode step calls the
    kernel once a layer, and its logits equal those of the step with the switch off (gate/up unfolded, inductor's
    reductions' torch form) within bf16 rounding."""
    model = adapted_model(torch.bfloat16, target_modules="all-linear").cuda().eval()
    parts = decoder_parts(model)
    stacks = refresh_fusions(parts)
    assert all(stack.extra_rows == 16 for stack in stacks if stack.group == "fused_gate_up")
    decode = decode_step_on_random_cache(parts, batch=16, columns=64, write_at=40, starts_below=10)
    calls = []
    original = lora_a_product.a_product

    def counted(rows, a_rows, ranks):
        calls.append(ranks)
        return original(rows, a_rows, ranks)

    monkeypatch.setattr(lora_a_product, "a_product", counted)
    with_kernel = decode()
    assert calls == [8] * len(parts.layers)
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", False)
    assert all(stack.extra_rows == 0 for stack in refresh_fusions(parts) if stack.group == "fused_gate_up")
    without = decode()
    assert len(calls) == len(parts.layers)
    error = ((with_kernel - without).norm() / without.norm()).item()
    assert error < 2e-2, error
