"""`rollout.l2_prefetch`: which weights a layer's prefetches cover, that they never change a decode step, and (on CUDA)
that they run inside the compiled, captured step on a side stream that the step joins back."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GenerationConfig

from prorl_trl.rollout import l2_prefetch
from prorl_trl.rollout.decoder import (
    attention_weights,
    decode_logits,
    decoder_parts,
    mlp_weights,
    plan_fusions,
    refresh_fusions,
    unload_stacks,
)
from prorl_trl.rollout.lora_decode import base_linear
from prorl_trl.tiny import build_tiny

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def lora_parts(targets=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj")):
    model, tokenizer = build_tiny(seed=0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    return model, tokenizer, decoder_parts(model.eval())


def test_weights_are_what_the_gemms_read_stacked_or_not():
    """Stacked (the engine's generations): q/k/v, gate/up, o and down (their A rows folded) are the stacked copies,
    every base row and folded row included. Not stacked: the base layers' own weights, never a LoRA factor."""
    _, _, parts = lora_parts()
    stacks = refresh_fusions(parts)
    for index, layer in enumerate(parts.layers):
        attention, mlp = attention_weights(parts, index), mlp_weights(parts, index)
        assert [t is s for t, s in zip(attention, (parts.fused_qkv[index].stacked, parts.fused_o[index].stacked))] == [
            True, True]  # fmt: skip
        assert mlp[0] is parts.fused_gate_up[index].stacked and mlp[1] is parts.fused_down[index].stacked
        qkv_rows = sum(base_linear(getattr(layer.self_attn, n)).weight.shape[0] for n in ("q_proj", "k_proj", "v_proj"))
        assert attention[0].shape[0] == qkv_rows + parts.fused_qkv[index].extra_rows > qkv_rows  # A rows folded in
    unload_stacks(parts, stacks)
    for index, layer in enumerate(parts.layers):
        expected = [base_linear(getattr(layer.self_attn, n)).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        assert all(a is b for a, b in zip(attention_weights(parts, index), expected, strict=True))
        expected = [base_linear(getattr(layer.mlp, n)).weight for n in ("gate_proj", "up_proj", "down_proj")]
        assert all(a is b for a, b in zip(mlp_weights(parts, index), expected, strict=True))


def test_nothing_is_prefetched_off_cuda(monkeypatch):
    """On CPU the switches change nothing: no tensor is prefetchable, so no op runs and the logits are the same."""
    _, _, parts = lora_parts()
    plan_fusions(parts)
    assert l2_prefetch.prefetchable([p for p in parts.model.parameters()][:4]) == []
    batch, columns = 3, 12
    shape = (batch, parts.num_kv_heads, columns, parts.head_dim)
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, *shape, generator=generator) for _ in parts.layers]
    tokens, start, write_index = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.tensor([6])

    def step():
        keys, values = [c[0].clone() for c in caches], [c[1].clone() for c in caches]
        with torch.no_grad():
            return decode_logits(parts, tokens, start, write_index, keys, values, prefetch_order=torch.zeros(1))

    off = step()
    monkeypatch.setattr(l2_prefetch, "PREFETCH_MLP", True)
    monkeypatch.setattr(l2_prefetch, "PREFETCH_NEXT_ATTENTION", True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        on = step()
    assert not any("l2_prefetch" in event.key for event in profile.key_averages())
    assert torch.equal(on, off)


@cuda
def test_prefetch_kernel_covers_odd_sizes():
    """Sizes that are not a whole number of lines or blocks (1 element, 1,000 float32, 3 lines + 2 bytes): the last
    line is clamped, nothing outside the tensor is touched (the launches finish without a fault), contents unchanged."""
    from prorl_trl.rollout.l2_prefetch_triton import launch_prefetch

    for tensor in (torch.ones(1, dtype=torch.bfloat16, device="cuda"), torch.arange(1000.0, device="cuda"),
                   torch.arange(193, dtype=torch.int16, device="cuda")):  # fmt: skip
        before = tensor.clone()
        launch_prefetch(tensor, programs=16)
        torch.cuda.synchronize()
        assert torch.equal(tensor, before)
    with pytest.raises(ValueError, match="whole number"):
        launch_prefetch(torch.ones(3, dtype=torch.float64, device="cuda"), programs=1, line_bytes=12)


@cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_same_seed_same_tokens_with_prefetches_on(cuda_graphs, monkeypatch):
    """Sampled generations with both prefetches on equal those with them off, token for token (same seed), with the
    step compiled and captured (the side stream a branch of the graph, joined at the step's end) or launched eagerly;
    the prefetch kernel ran (eager run profiled) and nothing is left unjoined."""
    from prorl_trl.rollout.engine import RolloutEngine

    model, tokenizer, _ = lora_parts()
    model = model.cuda().train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 250, (6, 10), generator=generator).cuda()
    mask = torch.ones_like(input_ids)
    config = GenerationConfig(max_new_tokens=24, do_sample=True, top_p=0.8, top_k=0, temperature=1.0,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    off = RolloutEngine(steps_per_graph=8, cuda_graphs=cuda_graphs).generate(model, input_ids, mask, config, seed=5)
    monkeypatch.setattr(l2_prefetch, "PREFETCH_MLP", True)
    monkeypatch.setattr(l2_prefetch, "PREFETCH_NEXT_ATTENTION", True)
    engine = RolloutEngine(steps_per_graph=8, cuda_graphs=cuda_graphs)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        on = engine.generate(model, input_ids, mask, config, seed=5)
    assert engine.stats.compile_error is None, engine.stats.compile_error
    assert torch.equal(on.tokens, off.tokens)
    names = {event.key for event in profile.key_averages()}
    assert "prorl_rollout::l2_prefetch" in names, sorted(names)  # traced into the step (capture or eager calls)
    if not cuda_graphs:
        assert any("_prefetch_kernel" in name for name in names), sorted(names)
    assert l2_prefetch._pending == []
