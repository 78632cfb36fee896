"""Stacked q/k/v and gate/up base weights (prorl_trl.rollout.fused_weights, decoder.StackGroup) on the tiny Qwen2
model, real PEFT and torch.

A stack is a copy made for a generation: the outputs must be those of the modules, the Parameters must be left
exactly as they were (same objects, same storage: the optimizer, checkpoints, DeepSpeed's flat buffers see nothing),
and the next generation's copy must carry every update made since. A few seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from prorl_trl.rollout import fused_mlp, fused_weights, lora_decode
from prorl_trl.rollout.decoder import decode_logits, decoder_parts, refresh_fusions
from prorl_trl.tiny import build_tiny


def qkv(layer):
    attention = layer.self_attn
    return attention.q_proj, attention.k_proj, attention.v_proj


def gate_up(layer):
    return layer.mlp.gate_proj, layer.mlp.up_proj


def storage(model) -> dict[str, tuple[int, int]]:
    return {name: (p.data_ptr(), id(p)) for name, p in model.named_parameters()}


@torch.no_grad()
def test_stacks_are_copies_with_the_modules_outputs_and_the_parameters_untouched():
    model = build_tiny(seed=0)[0].eval()
    before = storage(model)
    parts = decoder_parts(model)
    stacks = refresh_fusions(parts)
    assert {stack.group for stack in stacks} == {"fused_qkv", "fused_gate_up"}  # o and down: nothing to fold
    assert len(stacks) == 2 * len(parts.layers) and all(not stack.extra_rows for stack in stacks)
    assert storage(model) == before  # same Parameter objects in the same storage
    for layer, fused in zip(parts.layers, parts.fused_qkv, strict=True):
        modules = qkv(layer)
        assert fused.extra_rows == 0 and fused.weight.data_ptr() not in {m.weight.data_ptr() for m in modules}
        x = torch.randn(3, 1, modules[0].in_features, generator=torch.Generator().manual_seed(0))
        for ours, module in zip(fused(x), modules, strict=True):
            torch.testing.assert_close(ours, module(x), rtol=1e-6, atol=1e-6)
    assert parts.fused_o == [None] * len(parts.layers) and parts.fused_down == [None] * len(parts.layers)


def test_the_next_generations_copy_carries_every_optimizer_step():
    model = build_tiny(seed=0)[0].train()
    parts = decoder_parts(model)
    refresh_fusions(parts)
    first = parts.fused_gate_up[1]
    copied = first.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    modules = gate_up(parts.layers[1])
    assert torch.equal(first.weight, copied)  # a copy: the step did not reach it ...
    assert not torch.equal(torch.cat([m.weight for m in modules]), copied)
    refresh_fusions(parts)  # ... the next generation's copy does
    again = parts.fused_gate_up[1]
    for member, part in zip(modules, again.weight.split(again.sizes), strict=True):
        assert torch.equal(member.weight, part)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj"], "all-linear"], ids=str)
def test_merged_save_after_stacking_a_lora_model_is_the_merged_model(tmp_path, targets):
    """A reset's merged save (`merged/reset-<k>/`) after the engine stacked the groups (with folded A rows for q/k/v,
    and o and down with all-linear): the saved weights are the merged model's, nothing of the stacks leaks in."""
    from transformers import AutoModelForCausalLM

    from prorl_trl.reset import merged_state_dict, save_merged_model
    from prorl_trl.tiny import build_tiny_tokenizer

    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    parts = decoder_parts(model)
    refresh_fusions(parts)
    assert all(f is not None and f.extra_rows for f in parts.fused_qkv)
    assert all(f is not None and not f.extra_rows for f in parts.fused_gate_up)
    single = parts.fused_o + parts.fused_down  # stacked only to fold their A products: when adapted
    assert all(bool(f is not None and f.extra_rows) == (targets == "all-linear") for f in single)
    expected = {name: tensor.detach().clone() for name, tensor in merged_state_dict(model).items()}
    folder = save_merged_model(model, build_tiny_tokenizer(), tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


@torch.no_grad()
def test_views_of_someone_elses_flat_buffer_are_copied_and_left_alone():
    """DeepSpeed ZeRO-1/2 keep bf16 parameters as views of one flat buffer (weights and biases interleaved): the stack
    copies their values and leaves the views where they are."""
    model = build_tiny(seed=0)[0].eval()
    modules = qkv(model.model.layers[0])
    params = [p for module in modules for p in (module.weight, module.bias)]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    pointers = [p.data_ptr() for p in params]
    parts = decoder_parts(model)
    refresh_fusions(parts)
    assert [p.data_ptr() for p in params] == pointers
    fused = parts.fused_qkv[0]
    assert torch.equal(fused.weight, torch.cat([m.weight for m in modules]))
    assert torch.equal(fused.bias, torch.cat([m.bias for m in modules]))


def test_groups_that_do_not_fit_are_not_stacked():
    model = build_tiny(seed=0)[0]
    attention = model.model.layers[0].self_attn
    assert not fused_weights.fusable((attention.q_proj,))  # one member (o and down stack only to fold)
    assert not fused_weights.fusable((attention.q_proj, attention.o_proj))  # bias and no bias
    assert not fused_weights.fusable((attention.o_proj, model.model.layers[0].mlp.down_proj))  # input widths
    with torch.device("meta"):
        on_meta = torch.nn.Linear(4, 4)
    assert not fused_weights.copyable((on_meta,))  # nothing to copy from (as FSDP's DTensor shards: not plain)
    buffer = torch.empty(2, attention.q_proj.in_features)
    with pytest.raises(ValueError, match="cannot stack"):
        fused_weights.stack_copies(qkv(model.model.layers[0]), buffer, None)


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
