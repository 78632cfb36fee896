"""On CUDA only: the compiled static-cache path must see LoRA weights as training changes them.

A CUDA graph replays fixed memory addresses, so a compiled decode step could in principle keep generating with stale
adapter weights after an optimizer step, a `.data` swap or a LoRA merge (what hard resets do). Each test compares
greedy tokens of the compiled path with TRL's eager default after such a change. Skipped without a GPU (CI); on the
device machine run `python tests/test_generation_gpu.py` (no pytest or TRL needed there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prorl_trl.rollout.compiled import enable_compiled_generation  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
NEW_TOKENS = 12


def lora_model():
    from peft import LoraConfig, get_peft_model

    model, tokenizer = build_tiny(seed=0)
    model = get_peft_model(model.cuda(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    model.train()  # as inside GRPOTrainer.training_step
    input_ids = torch.randint(3, 250, (4, 10), generator=torch.Generator().manual_seed(0)).cuda()
    return model, tokenizer, input_ids


def greedy(model, input_ids, pad: int, compiled: bool) -> torch.Tensor:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
    if compiled:
        enable_compiled_generation(config, max_cache_len=input_ids.shape[1] + NEW_TOKENS)
    else:
        config.disable_compile = True
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)


def lora_b_weights(model):
    return [param for name, param in model.named_parameters() if "lora_B" in name]


def assert_compiled_matches_eager(model, input_ids, pad):
    eager = greedy(model, input_ids, pad, compiled=False)
    for _ in range(2):  # the second call replays the captured graph
        assert torch.equal(greedy(model, input_ids, pad, compiled=True), eager)
    return eager


def test_compiled_generation_follows_in_place_optimizer_steps():
    model, tokenizer, input_ids = lora_model()
    before = assert_compiled_matches_eager(model, input_ids, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = assert_compiled_matches_eager(model, input_ids, tokenizer.pad_token_id)
    assert not torch.equal(after, before), "the update did not change generation; the test would prove nothing"


def test_compiled_generation_follows_swapped_and_merged_weights():
    model, tokenizer, input_ids = lora_model()
    pad = tokenizer.pad_token_id
    before = assert_compiled_matches_eager(model, input_ids, pad)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for weight in lora_b_weights(model):  # new storage, as `param.data = ...` in a reset
        weight.data = torch.randn(weight.shape, device="cuda", generator=generator)
    swapped = assert_compiled_matches_eager(model, input_ids, pad)
    assert not torch.equal(swapped, before)
    model.merge_adapter()  # base weights change in place; LoRA layers switch to their merged branch
    assert_compiled_matches_eager(model, input_ids, pad)
    model.unmerge_adapter()
    assert_compiled_matches_eager(model, input_ids, pad)


if __name__ == "__main__":
    for test in (test_compiled_generation_follows_in_place_optimizer_steps,
                 test_compiled_generation_follows_swapped_and_merged_weights):
        test()
        print(f"PASSED {test.__name__}", flush=True)
