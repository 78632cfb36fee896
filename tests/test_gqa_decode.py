"""Grouped-query decode attention (prorl_trl.rollout.gqa_attention.use_gqa_decode_attention): same results as transformers' SDPA,
no per-head copies of the cache in one-token steps, and only switched on where it applies."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_generation import build_trainer, cpu_compile_config
from transformers import AttentionInterface, AutoModelForCausalLM, GenerationConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from prorl_trl.rollout.compiled import configure_trainer_generation, enable_compiled_generation
from prorl_trl.rollout.gqa_attention import GQA_DECODE_ATTENTION, sdpa_gqa_decode_forward, use_gqa_decode_attention
from prorl_trl.tiny import build_tiny


class GroupedAttention(torch.nn.Module):
    """Stands in for a decoder attention layer: all the attention functions read from the module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def decode_inputs(batch=3, kv_heads=2, groups=3, cache=10, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, cache, dim, generator=generator) for _ in range(2))
    mask = torch.ones(batch, 1, 1, cache, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[1, ..., 7:] = False  # unwritten static-cache slots
    return query, key, value, mask


def test_decode_step_equals_attention_over_repeated_heads(monkeypatch):
    query, key, value, mask = decode_inputs()
    module = GroupedAttention(groups=3).eval()
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    output, weights = sdpa_gqa_decode_forward(module, query, key, value, mask, scaling=0.3)
    assert weights is None and calls == [((3, 2, 3, 8), (3, 2, 10, 8))]  # query heads packed, keys not repeated

    expected = original(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert output.shape == (3, 1, 6, 8)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["prefill", "per_head_mask", "no_groups", "dropout"])
def test_every_other_call_is_transformers_sdpa_unchanged(case):
    query, key, value, mask = decode_inputs()
    groups, dropout = 3, 0.0
    if case == "prefill":
        query = torch.randn(3, 6, 4, 8)
        mask = torch.ones(3, 1, 4, 10, dtype=torch.bool).tril(diagonal=6)
    elif case == "per_head_mask":
        mask = mask.expand(3, 6, 1, 10).clone()
    elif case == "no_groups":
        groups, key, value = 1, repeat_kv(key, 3), repeat_kv(value, 3)
    else:
        dropout = 0.5
    module = GroupedAttention(groups).train(case == "dropout")
    torch.manual_seed(0)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=0.3)
    torch.manual_seed(0)
    got, _ = sdpa_gqa_decode_forward(module, query, key, value, mask, dropout=dropout, scaling=0.3)
    assert torch.equal(got, expected)


def greedy(model, compiled: bool):
    input_ids = torch.tensor([[3, 40, 41, 42, 43], [0, 0, 50, 51, 52]])
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
    if compiled:
        enable_compiled_generation(config, max_cache_len=16, compile_config=cpu_compile_config())
    else:
        config.disable_compile = True
    with torch.no_grad():
        output = model.generate(input_ids=input_ids, attention_mask=(input_ids != 0).long(), generation_config=config)
    return output.sequences, torch.stack(output.scores)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-static"])
def test_switched_model_generates_the_same_tokens_and_scores(compiled):
    reference, _ = build_tiny(seed=0)
    switched, _ = build_tiny(seed=0)
    assert use_gqa_decode_attention(switched) is True
    assert switched.config._attn_implementation == GQA_DECODE_ATTENTION
    assert GQA_DECODE_ATTENTION in AttentionInterface._global_mapping
    assert GQA_DECODE_ATTENTION in AttentionMaskInterface._global_mapping  # masks built as for SDPA
    expected_tokens, expected_scores = greedy(reference.eval(), compiled)
    tokens, scores = greedy(switched.eval(), compiled)
    assert torch.equal(tokens, expected_tokens)
    finite = torch.isfinite(expected_scores)
    assert torch.equal(torch.isfinite(scores), finite)
    torch.testing.assert_close(scores[finite], expected_scores[finite], rtol=1e-5, atol=1e-5)
    if compiled:
        assert hasattr(switched, "_compiled_call")


def test_switch_applies_only_to_grouped_query_sdpa_models_and_is_idempotent():
    multi_head, _ = build_tiny(seed=0, num_key_value_heads=4)
    assert use_gqa_decode_attention(multi_head) is False and multi_head.config._attn_implementation == "sdpa"
    eager, _ = build_tiny(seed=0)
    eager.set_attn_implementation("eager")
    assert use_gqa_decode_attention(eager) is False and eager.config._attn_implementation == "eager"
    model, _ = build_tiny(seed=0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    assert use_gqa_decode_attention(peft_model) is True and use_gqa_decode_attention(peft_model) is True
    assert model.config._attn_implementation == GQA_DECODE_ATTENTION


def test_saved_model_does_not_carry_the_custom_attention(tmp_path):
    model, _ = build_tiny(seed=0)
    use_gqa_decode_attention(model)
    model.save_pretrained(tmp_path)
    assert GQA_DECODE_ATTENTION not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation != GQA_DECODE_ATTENTION


def test_trainer_helper_switches_the_policy_and_a_step_trains(tmp_path):
    trainer = build_trainer(tmp_path, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    configure_trainer_generation(
        trainer, max_prompt_length=64, compile_config=cpu_compile_config(), require_accelerator=False
    )
    assert trainer.model.get_base_model().config._attn_implementation == GQA_DECODE_ATTENTION
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
