"""Fused q/k/v and gate/up base weights (prorl_trl.rollout.fused_weights) on the tiny Qwen2 model, real PEFT and torch.

Fusing re-points the Parameters into one allocation per group: the outputs must stay those of the modules, the
Parameter objects and the optimizer must keep working on them (an AdamW step lands in the fused storage), checkpoints
must round-trip (`save_pretrained`/`from_pretrained`, `torch.save`), re-pointing by someone else must be noticed
(`holds`, `refresh_fusions`), and storage someone else owns (DeepSpeed's flat buffers) must be left alone.
A few seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from prorl_trl.rollout import fused_mlp, fused_weights, lora_decode
from prorl_trl.rollout.decoder import decode_logits, decoder_parts, refresh_fusions
from prorl_trl.tiny import build_tiny


def qkv(layer):
    attention = layer.self_attn
    return attention.q_proj, attention.k_proj, attention.v_proj


def gate_up(layer):
    return layer.mlp.gate_proj, layer.mlp.up_proj


@torch.no_grad()
def test_fusing_keeps_outputs_parameters_and_values():
    model = build_tiny(seed=0)[0].eval()
    layer = model.model.layers[0]
    modules = qkv(layer)
    params = [p for module in modules for p in (module.weight, module.bias)]
    values = [p.detach().clone() for p in params]
    x = torch.randn(3, 1, modules[0].in_features, generator=torch.Generator().manual_seed(0))
    expected = [module(x) for module in modules]
    fused = fused_weights.fuse_linears(modules)
    assert fused is not None and fused.holds()
    assert [p for module in modules for p in (module.weight, module.bias)] == params  # same Parameter objects
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert len({p.untyped_storage().data_ptr() for p in (m.weight for m in modules)}) == 1  # one allocation
    assert fused.weight.shape == (sum(m.out_features for m in modules), modules[0].in_features)
    for ours, reference in zip(fused(x), expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert fused_weights.fuse_linears(modules).weight.data_ptr() == fused.weight.data_ptr()  # reused, not copied


def test_optimizer_steps_land_in_the_fused_storage():
    model = build_tiny(seed=0)[0].train()
    modules = gate_up(model.model.layers[1])
    fused = fused_weights.fuse_linears(modules)
    before = fused.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert all(m.weight.grad is not None and m.weight.grad.shape == m.weight.shape for m in modules)
    optimizer.step()
    assert fused.holds()
    assert not torch.equal(fused.weight, before)
    for member, part in zip(modules, fused.weight.split(fused.sizes), strict=True):
        assert torch.equal(member.weight, part)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_model_round_trips_through_checkpoints(tmp_path, tied):
    model = build_tiny(seed=0)[0].eval()
    if tied:  # as Qwen2-0.5B has: the one storage transformers already shares on purpose
        model.config.tie_word_embeddings = True
        model.tie_weights()
    parts = decoder_parts(model)
    refresh_fusions(parts)
    assert all(f is not None for f in parts.fused_qkv + parts.fused_gate_up)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    torch.save(model.state_dict(), tmp_path / "state.pt")
    for name, tensor in torch.load(tmp_path / "state.pt", weights_only=True).items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.parametrize("targets", [["q_proj", "k_proj"], "all-linear"], ids=str)
def test_merged_save_of_a_fused_lora_model_loads_back(tmp_path, targets):
    """A reset's merged save (`merged/reset-<k>/`) after the engine fused the base: adapted weights merged, the rest
    saved as the views they are, also o and down alone in allocations with folded A rows after them (all-linear)."""
    from prorl_trl.reset import merged_state_dict, save_merged_model
    from prorl_trl.tiny import build_tiny_tokenizer

    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    parts = decoder_parts(model)
    refresh_fusions(parts)
    assert all(f is not None for f in parts.fused_qkv + parts.fused_gate_up)
    assert all(f.extra_rows for f in parts.fused_qkv)
    single = parts.fused_o + parts.fused_down  # fused only to fold their A products: when adapted
    assert all(bool(f is not None and f.extra_rows) == (targets == "all-linear") for f in single)
    expected = {name: tensor.detach().clone() for name, tensor in merged_state_dict(model).items()}
    folder = save_merged_model(model, build_tiny_tokenizer(), tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


@torch.no_grad()
def test_re_pointed_members_are_noticed_and_fused_again():
    model = build_tiny(seed=0)[0].eval()
    parts = decoder_parts(model)
    refresh_fusions(parts)
    first = parts.fused_qkv[0]
    q_proj = qkv(parts.layers[0])[0]
    q_proj.weight.data = q_proj.weight.data.clone() + 1  # as `module.to`, `load_state_dict(assign=True)` would
    assert not first.holds()
    refresh_fusions(parts)
    again = parts.fused_qkv[0]
    assert again is not first and again.holds()
    assert torch.equal(again.weight[: q_proj.out_features], q_proj.weight)
    assert parts.fused_qkv[1] is not None and parts.fused_qkv[1].holds()


@torch.no_grad()
def test_storage_owned_by_someone_else_is_left_alone():
    """DeepSpeed ZeRO-1/2 keep bf16 parameters as views of one flat buffer (weights and biases interleaved)."""
    model = build_tiny(seed=0)[0].eval()
    modules = qkv(model.model.layers[0])
    params = [p for module in modules for p in (module.weight, module.bias)]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    pointers = [p.data_ptr() for p in params]
    assert fused_weights.fuse_linears(modules) is None
    assert [p.data_ptr() for p in params] == pointers  # nothing re-pointed


def test_groups_that_do_not_fit_are_not_fused():
    model = build_tiny(seed=0)[0]
    attention = model.model.layers[0].self_attn
    assert fused_weights.fuse_linears((attention.q_proj,)) is None  # one member
    assert fused_weights.fuse_linears((attention.q_proj, attention.o_proj)) is None  # bias and no bias
    assert fused_weights.fuse_linears((attention.o_proj, model.model.layers[0].mlp.down_proj)) is None  # widths


@pytest.mark.parametrize("targets", [["q_proj", "k_proj"], "all-linear"], ids=str)
@torch.no_grad()
def test_decode_logits_with_fused_bases_equal_separate_gemms(targets, monkeypatch):
    """The whole decode step, LoRA on top of fused bases, against the same step with every base its own GEMM. (With
    gate/up adapted, `fused_mlp` would read the fused weight itself: off here, test_lora_decode covers it.)"""
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", False)
    torch.manual_seed(0)
    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=targets)).eval()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    parts = decoder_parts(model)
    batch, cache_len = 3, 12
    shape = (batch, parts.num_kv_heads, cache_len, parts.head_dim)
    generator = torch.Generator().manual_seed(1)
    caches = [torch.randn(shape, generator=generator) for _ in range(2 * len(parts.layers))]
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=generator)
    start, write_index = torch.tensor([0, 2, 5]), torch.tensor([7])

    def logits():
        keys = [c.clone() for c in caches[: len(parts.layers)]]
        values = [c.clone() for c in caches[len(parts.layers) :]]
        return decode_logits(parts, tokens, start, write_index, keys, values)

    separate = logits()
    refresh_fusions(parts)
    assert all(f is not None for f in parts.fused_qkv + parts.fused_gate_up)
    calls = []
    original = fused_weights.FusedLinear.__call__
    monkeypatch.setattr(fused_weights.FusedLinear, "__call__",
                        lambda self, x, **kwargs: calls.append(self) or original(self, x, **kwargs))  # fmt: skip
    folded = []
    product = lora_decode._float32_product
    monkeypatch.setattr(lora_decode, "_float32_product",
                        lambda rows, weight: folded.append(weight) or product(rows, weight))  # fmt: skip
    fused = logits()
    # every group ran as one GEMM: adapted q/k/v (and o, down) with their A products folded in, gate/up plain
    single = sum(f is not None for f in parts.fused_o + parts.fused_down)  # o, down: fused only to fold
    assert len(calls) + len(folded) == 2 * len(parts.layers) + single
    assert len(folded) >= len(parts.layers)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


def test_fuse_switch_off_keeps_separate_gemms(monkeypatch):
    monkeypatch.setattr(fused_weights, "FUSE_BASE", False)
    model = build_tiny(seed=0)[0]
    parts = decoder_parts(model)
    refresh_fusions(parts)
    assert parts.fused_qkv == [] and parts.fused_gate_up == []
    assert lora_decode.FUSE_LORA  # the other switch is independent
