"""The decode step's LoRA path (prorl_trl.rollout.lora_decode) against PEFT's own `lora.Linear.forward`.

Real PEFT adapters on the tiny model, lora_B perturbed (a fresh adapter's B is zero and would hide any error): the
fused projections equal calling the modules (float32: to 1e-6; bf16 base + PEFT's float32 adapters: within one bf16
ulp, mostly identical), for q,k targets, all linear layers, and ranks and scalings that differ inside a group; layers
the path cannot reproduce (DoRA, several active adapters, merged, disabled) are called as modules. The gated MLP as
`fused_mlp`'s function where gate/up carry adapters. `decode_logits` fused equals unfused and traces without a graph
break. About 15 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from prorl_trl.reset import freeze_lora_delta, frozen_layers, lora_layers, reinit_adapter
from prorl_trl.reset.frozen import FROZEN_MODULE, frozen_delta_of
from prorl_trl.rollout import fused_mlp, lora_decode
from prorl_trl.rollout.decoder import decode_logits, decoder_parts, refresh_fusions
from prorl_trl.tiny import build_tiny

CASES = {
    "q,k": dict(target_modules=["q_proj", "k_proj"]),
    "all-linear, ranks differ": dict(target_modules="all-linear", rank_pattern={"k_proj": 8, "up_proj": 2},
                                     alpha_pattern={"v_proj": 3}),
}  # fmt: skip


def adapted_model(dtype: torch.dtype, **lora):
    torch.manual_seed(0)
    model = get_peft_model(build_tiny(seed=0)[0].to(dtype), LoraConfig(r=4, lora_alpha=8, **lora))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    return model.eval()


def projection_groups(model) -> list[tuple]:
    """The projections the decode step groups, per layer: q/k/v, o, gate/up, down."""
    groups = []
    for layer in decoder_parts(model).layers:
        attention, mlp = layer.self_attn, layer.mlp
        groups += [(attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
                   (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]  # fmt: skip
    return groups


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(values.abs().float().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(exponent - 7)  # bf16 keeps 7 explicit mantissa bits


def assert_outputs_match(ours_list, references, float32_tolerance: float) -> tuple[int, int]:
    """float32: close to `float32_tolerance`; 16-bit: within one ulp. Returns (identical elements, elements compared)
    for the 16-bit case ((0, 0) for float32)."""
    identical = compared = 0
    for ours, reference in zip(ours_list, references, strict=True):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        if reference.dtype == torch.float32:
            torch.testing.assert_close(ours, reference, atol=float32_tolerance, rtol=float32_tolerance)
            continue
        difference = (ours.float() - reference.float()).abs()
        assert (difference <= bf16_ulp(torch.maximum(ours.abs(), reference.abs()))).all()
        identical += int((ours == reference).sum())
        compared += reference.numel()
    return identical, compared


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_fused_projections_equal_peft_modules(case, dtype):
    model = adapted_model(dtype, **CASES[case])
    generator = torch.Generator().manual_seed(1)
    fused = identical = compared = 0
    scalings = set()
    for modules in projection_groups(model):
        x = torch.randn(5, 1, modules[0].in_features, generator=generator).to(dtype)
        factors = [lora_decode.lora_factors(module, x) for module in modules]
        fused += sum(factor is not None for factor in factors)
        scalings |= {factor.scaling for factor in factors if factor is not None}
        for factor in factors:
            assert factor is None or factor.down.dtype == torch.float32  # PEFT keeps adapters in float32
        same, count = assert_outputs_match(lora_decode.project(x, modules), [module(x) for module in modules], 1e-6)
        identical, compared = identical + same, compared + count
    adapted = sum(hasattr(module, "lora_A") for group in projection_groups(model) for module in group)
    assert fused == adapted > 0  # every adapted projection took the fused path
    if case != "q,k":
        assert scalings == {2.0, 1.0, 0.75, 4.0}  # alpha/r: 8/4, k_proj 8/8, v_proj 3/4, up_proj 8/2 (in shared groups)
    if dtype == torch.bfloat16:
        assert identical >= 0.9 * compared, f"{identical}/{compared} outputs identical"


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_fused_gated_activation_equals_the_mlp(case, dtype, monkeypatch):
    """`fused_mlp.FUSED_MLP` (on CPU its torch reference; the kernel is tested in test_fused_mlp): the MLP through
    `gated_mlp` equals calling it, with LoRA on gate/up (ranks differing inside the group: the fused path) and without
    (the separate projections: cuBLAS won there)."""
    assert fused_mlp.FUSED_MLP  # on by default
    model = adapted_model(dtype, **CASES[case])
    parts = decoder_parts(model)
    refresh_fusions(parts)
    generator = torch.Generator().manual_seed(3)
    for layer, fused in zip(parts.layers, parts.fused_gate_up, strict=True):
        x = torch.randn(5, 1, layer.mlp.gate_proj.in_features, generator=generator).to(dtype)
        adapted = hasattr(layer.mlp.up_proj, "lora_A")
        assert (lora_decode._fused_gated_activation(layer.mlp, x, fused) is not None) == adapted
        ours, reference = lora_decode.gated_mlp(layer.mlp, x, fused), layer.mlp(x)
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
        else:  # bf16 roundings of gate, up and their product: a few ulps after down_proj
            torch.testing.assert_close(ours.float(), reference.float(), atol=0.05, rtol=0.02)
    mlp = parts.layers[0].mlp
    x = torch.randn(3, 1, mlp.gate_proj.in_features, generator=generator).to(dtype)
    mlp.act_fn = torch.nn.GELU()  # not SiLU: the projections run as before, the MLP's function kept
    assert lora_decode._fused_gated_activation(mlp, x, parts.fused_gate_up[0]) is None
    torch.testing.assert_close(lora_decode.gated_mlp(mlp, x, parts.fused_gate_up[0]), mlp(x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_layers_the_path_cannot_reproduce_are_called_as_modules():
    """DoRA, two active adapters, merged or disabled adapters: `lora_factors` declines and `project` returns exactly
    the module's output."""
    torch.manual_seed(0)
    x = torch.randn(3, 1, 64)
    dora = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, target_modules=["q_proj", "k_proj"], use_dora=True))
    two = adapted_model(torch.float32, target_modules=["q_proj", "k_proj"])
    two.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    two.base_model.set_adapter(["default", "other"])
    merged = adapted_model(torch.float32, target_modules=["q_proj", "k_proj"])
    merged.merge_adapter()
    disabled = adapted_model(torch.float32, target_modules=["q_proj", "k_proj"])
    disabled.base_model.disable_adapter_layers()
    for model in (dora, two, merged, disabled):
        attention = decoder_parts(model).layers[0].self_attn
        modules = (attention.q_proj, attention.k_proj, attention.v_proj)
        assert all(lora_decode.lora_factors(module, x) is None for module in modules)
        for ours, reference in zip(lora_decode.project(x, modules), [module(x) for module in modules], strict=True):
            assert torch.equal(ours, reference)
    single = adapted_model(torch.float32, target_modules=["q_proj", "k_proj"])
    assert lora_decode.lora_factors(decoder_parts(single).layers[0].self_attn.q_proj, x) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast would run PEFT's products in bf16
        assert lora_decode.lora_factors(decoder_parts(single).layers[0].self_attn.q_proj, x) is None


@torch.no_grad()
def test_decode_logits_fused_equals_unfused_and_traces_whole(monkeypatch):
    model = adapted_model(torch.float32, **CASES["all-linear, ranks differ"])
    parts = decoder_parts(model)
    batch, columns = 4, 12
    generator = torch.Generator().manual_seed(2)
    shape = (batch, parts.num_kv_heads, columns, parts.head_dim)
    caches = [torch.randn(2, *shape, generator=generator) for _ in parts.layers]
    tokens, start, write_index = torch.tensor([5, 9, 40, 7]), torch.tensor([0, 2, 1, 3]), torch.tensor([6])

    def step():
        keys, values = [cache[0].clone() for cache in caches], [cache[1].clone() for cache in caches]
        return decode_logits(parts, tokens, start, write_index, keys, values), keys, values

    def same_step_another_way(switched, reference):
        """The step with a switch flipped: other kernels (not bit-identical: the switch took effect), same values,
        and still one graph for the compiler."""
        for ours, expected in zip(switched, reference, strict=True):
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        assert not torch.equal(switched[0], fused[0])
        explanation = torch._dynamo.explain(step)()
        assert explanation.graph_break_count == 0, explanation.break_reasons

    fused = step()
    monkeypatch.setattr(lora_decode, "FUSE_LORA", False)
    unfused = step()
    monkeypatch.setattr(lora_decode, "FUSE_LORA", True)
    same_step_another_way(unfused, fused)
    refresh_fusions(parts)  # gate/up stored as one and adapted: the MLP's first half as `fused_mlp`'s function
    mlp = parts.layers[0].mlp
    assert lora_decode._fused_gated_activation(mlp, torch.zeros(batch, 1, mlp.gate_proj.in_features),
                                               parts.fused_gate_up[0]) is not None  # fmt: skip
    same_step_another_way(step(), unfused)


def adapter_down(module) -> torch.Tensor | None:
    """The active adapter's A weight of a PEFT LoRA layer, else None."""
    adapters = getattr(module, "lora_A", None)
    return adapters["default"].weight if isinstance(adapters, torch.nn.ModuleDict) and "default" in adapters else None


def decode_step_on_random_cache(parts, batch: int, columns: int, write_at: int, starts_below: int, device="cuda"):
    """A function running one `decode_logits` step of `parts` over fixed random bf16 KV caches (fresh copies each
    call, so calls compare), tokens and left paddings, writing at column `write_at`."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, parts.num_kv_heads, columns, parts.head_dim)
    caches = [torch.randn(2, *shape, device=device, generator=generator).to(torch.bfloat16) for _ in parts.layers]
    tokens = torch.randint(3, 250, (batch,), device=device, generator=generator)
    start = torch.randint(0, starts_below, (batch,), device=device, generator=generator)
    write_index = torch.tensor([write_at], device=device)

    def step():
        keys, values = [cache[0].clone() for cache in caches], [cache[1].clone() for cache in caches]
        return decode_logits(parts, tokens, start, write_index, keys, values)

    return step


def folded_groups(parts) -> list[tuple]:
    """(modules, fused) for every group `refresh_fusions` gave extra A rows: q/k/v, o, down."""
    groups = []
    for index, layer in enumerate(parts.layers):
        attention, mlp = layer.self_attn, layer.mlp
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        for modules, fused in ((qkv, parts.fused_qkv[index]), ((attention.o_proj,), parts.fused_o[index]),
                               ((mlp.down_proj,), parts.fused_down[index])):
            if fused is not None and fused.extra_rows:
                groups.append((modules, fused))
    return groups


def assert_folded_equal_modules(parts, dtype, generator) -> tuple[int, int, int]:
    """Every folded group's `project` against calling its modules (as test_fused_projections_equal_peft_modules);
    returns (groups that took the fold, identical outputs, outputs compared)."""
    folds = identical = compared = 0
    for modules, fused in folded_groups(parts):
        x = torch.randn(5, 1, modules[0].in_features, generator=generator).to(dtype)
        factors = [lora_decode.lora_factors(module, x) for module in modules]
        stages = [lora_decode.stage_of(module, live) for module, live in zip(modules, factors)]
        folds += lora_decode._folded(x, fused, stages) is not None
        same, count = assert_outputs_match(lora_decode.project(x, modules, fused), [m(x) for m in modules], 1e-5)
        identical, compared = identical + same, compared + count
    return folds, identical, compared


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_folded_a_products_equal_peft_through_updates_and_a_new_rank(case, dtype):
    """A weights as extra rows of the base GEMM (`fold_rows`, `refresh_folded`, `_folded`): PEFT's outputs (bf16 base:
    within one ulp, mostly identical; the float32 adapters carried as two bf16 rows to ~2^-16), after an in-place
    update of A (copied again by the next `refresh_fusions`, as every generation does), and after a hard reset gives
    the adapters another rank (the groups are fused again with room for it)."""
    model = adapted_model(dtype, **CASES[case])
    parts = decoder_parts(model)
    refresh_fusions(parts)
    adapted_groups = sum(any(adapter_down(m) is not None for m in modules) for modules in projection_groups(model)
                         if len(modules) != 2)  # gate/up's A products go to fused_mlp, not folded  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    folds, identical, compared = assert_folded_equal_modules(parts, dtype, generator)
    assert folds == len(folded_groups(parts)) == adapted_groups > 0  # q/k/v (and o, down when adapted) folded
    for modules, fused in folded_groups(parts):
        downs = [adapter_down(m) for m in modules if adapter_down(m) is not None]
        ranks = sum(d.shape[0] for d in downs)
        high = fused.extra[:ranks].float()
        carried = high + fused.extra[ranks:].float() if dtype == torch.bfloat16 else high
        assert fused.extra_rows == ranks * (2 if dtype == torch.bfloat16 else 1)
        exact = torch.cat(downs)
        assert (carried - exact).abs().max() <= exact.abs().max() * 2.0**-15
    if dtype == torch.bfloat16:
        assert identical >= 0.9 * compared, f"{identical}/{compared} outputs identical"

    for name, param in model.named_parameters():  # an optimizer step, in place
        if "lora_A" in name:
            param.mul_(-1.5).add_(0.01)
    stale = assert_folded_equal_modules
    with pytest.raises(AssertionError):
        stale(parts, dtype, torch.Generator().manual_seed(3))  # the rows are copies: stale until refreshed
    refresh_fusions(parts)
    assert assert_folded_equal_modules(parts, dtype, torch.Generator().manual_seed(3))[0] == adapted_groups

    # a hard reset with another rank and targets (the layers and their fused base weights stay)
    model = get_peft_model(model.unload(), LoraConfig(r=6, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    assert all(adapter_down(m).dtype == torch.float32 for m in model.modules() if adapter_down(m) is not None)
    refresh_fusions(parts)
    assert {f.extra_rows for _, f in folded_groups(parts)} == {6 * (2 if dtype == torch.bfloat16 else 1)}
    assert all(f is None for f in parts.fused_down)  # down lost its adapter: a plain GEMM again
    folds, _, _ = assert_folded_equal_modules(parts, dtype, torch.Generator().manual_seed(4))
    assert folds == 2 * len(parts.layers)


def frozen_model(dtype: torch.dtype, **lora):
    """An adapted model after two hard resets that kept each delta as frozen factors (the second with another
    lora_alpha where the config has no per-layer patterns, so the concatenation carries a scaling ratio), with a
    trained live adapter on top."""
    model = adapted_model(dtype, **lora)
    for seed, alpha in ((5, None), (6, None if "alpha_pattern" in lora else 12)):
        freeze_lora_delta(model)
        reinit_adapter(model, lora_alpha=alpha, seed=seed)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.3)
    return model.eval()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_frozen_factors_of_earlier_resets_take_part_in_every_projection_path(case, dtype, monkeypatch):
    """The frozen factors sit in the base layers' hooks; where the decode step computes base outputs from stacked
    copies it must add them itself: called as modules (the hook), stacked GEMMs (`_apply_stages` on the raw outputs),
    folded A rows (each module's frozen parts' A weights, then its live one's), and gate/up leave `fused_mlp`'s kernel
    for `project`.
    Each path equals calling the modules (float32: to 1e-5; bf16: within one ulp, mostly identical: one rounding, as
    PEFT's), and differs from the same step without the frozen factors."""
    model = frozen_model(dtype, **CASES[case])
    frozen = frozen_layers(model)
    assert frozen and all(  # two resets, one part each of the layer's rank
        [down.shape[0] for down, _, _ in frozen_delta_of(layer.base_layer).parts] == [layer.r["default"]] * 2
        for _, layer in lora_layers(model)
    )
    parts = decoder_parts(model)
    generator = torch.Generator().manual_seed(7)
    for modules in projection_groups(model):  # unfused: the hooks do it
        x = torch.randn(5, 1, modules[0].in_features, generator=generator).to(dtype)
        assert_outputs_match(lora_decode.project(x, modules), [module(x) for module in modules], 1e-5)

    refresh_fusions(parts)  # stacked with folded A rows: the live ranks, then the frozen ranks
    folds, identical, compared = assert_folded_equal_modules(parts, dtype, generator)
    assert folds == len(folded_groups(parts)) > 0
    for modules, fused in folded_groups(parts):
        live = sum(adapter_down(m).shape[0] for m in modules if adapter_down(m) is not None)
        kept = sum(f.rank for m in modules if (f := frozen_delta_of(lora_decode.base_linear(m))) is not None)
        assert kept > 0
        assert fused.extra_rows == (live + kept) * (2 if dtype == torch.bfloat16 else 1)
    if dtype == torch.bfloat16:
        assert identical >= 0.9 * compared, f"{identical}/{compared} outputs identical"

    monkeypatch.setattr(lora_decode, "FOLD_LORA_A", False)  # stacked without folds: the frozen stage on raw outputs
    refresh_fusions(parts)
    qkv = (parts.layers[0].self_attn.q_proj, parts.layers[0].self_attn.k_proj, parts.layers[0].self_attn.v_proj)
    x = torch.randn(5, 1, qkv[0].in_features, generator=generator).to(dtype)
    stacked = lora_decode.project(x, qkv, parts.fused_qkv[0])
    assert_outputs_match(stacked, [module(x) for module in qkv], 1e-5)
    if case != "q,k":
        mlp = parts.layers[0].mlp
        h = torch.randn(5, 1, mlp.gate_proj.in_features, generator=generator).to(dtype)
        assert lora_decode._fused_gated_activation(mlp, h, parts.fused_gate_up[0]) is None
        gated = lora_decode.gated_mlp(mlp, h, parts.fused_gate_up[0], parts.fused_down[0])
        assert_outputs_match([gated], [mlp(h)], 1e-5)
    for _, base, _ in frozen:  # without the frozen factors the same step gives other outputs: they were in use
        delattr(base, FROZEN_MODULE)
    without = lora_decode.project(x, qkv, parts.fused_qkv[0])
    assert any(not torch.equal(a, b) for a, b in zip(without, stacked) if a.numel())
