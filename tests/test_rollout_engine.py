"""The rollout engine (prorl_trl.rollout) on CPU, graphs off: the same step function the CUDA graphs capture.

Against transformers: the filters against its logits warpers, greedy tokens against `generate`, token frequencies
against `generate` and against the exact processed distribution (chi-square), EOS/padding/length conventions against
`generate`'s output; plus seeding, the noise, the recapture decisions, and the Triton kernel (interpreter, if Triton
is installed). CUDA graphs and weight visibility: tests/test_rollout_engine_gpu.py. About 25 s on 2 cores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from prorl_trl.reset import freeze_lora_delta, frozen_layers, reinit_adapter
from prorl_trl.rollout import decode_attention, fused_mlp, lora_a_product, lora_decode, sampler
from prorl_trl.rollout.decode_attention import gqa_decode_attention_reference, triton_available
from prorl_trl.rollout.engine import RolloutEngine, resolved_generation_config, unsupported_reason
from prorl_trl.rollout.sampler import (
    SamplerTensors,
    UnsupportedGeneration,
    choose_tokens,
    first_argmax,
    process_logits,
    race_tokens,
    row_keys,
    sampler_settings,
    top_p_threshold,
    uniform_noise,
)
from prorl_trl.tiny import build_tiny

DRAWS = 20_000


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    return model.eval(), tokenizer


def config(tokenizer, **kwargs) -> GenerationConfig:
    defaults = dict(max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, repetition_penalty=1.0,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    return GenerationConfig(**{**defaults, **kwargs})


def left_padded(batch: int, width: int, pad: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 250, (batch, width), generator=generator)
    mask = torch.ones_like(input_ids)
    for row in range(batch):
        mask[row, : row % 4] = 0
        input_ids[row, : row % 4] = pad
    return input_ids, mask


def warped(scores: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=None) -> torch.Tensor:
    """transformers' own warpers, in `_get_logits_processor`'s order."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        processors.append(MinPLogitsWarper(min_p))
    return processors(None, scores.clone())


def ours(scores: torch.Tensor, ways: int = 2, **kwargs) -> torch.Tensor:
    generation = GenerationConfig(do_sample=True, max_new_tokens=1, eos_token_id=0, pad_token_id=0, **kwargs)
    settings = sampler_settings(generation)
    tensors = SamplerTensors.allocate(1, scores.device)
    tensors.load(settings, seed=0)
    return process_logits(scores, settings.layout, tensors, torch.zeros(1, dtype=torch.long), ways)


def logit_sets(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        real = model(input_ids=torch.randint(3, 250, (6, 7), generator=generator)).logits[:, -1].float()
    return {
        "model": real,
        "peaked": torch.randn(6, 300, generator=generator) * 6,
        "flat": torch.randn(6, 300, generator=generator) * 0.05,
        "wide": torch.randn(4, 5000, generator=generator) * 2,
    }


SETTINGS = [
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=1.2, min_p=0.1),
    dict(temperature=1.0, top_p=0.05),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_filters_match_transformers_warpers(tiny, settings):
    """Same kept set and the same renormalised probabilities as TemperatureLogitsWarper -> TopK -> TopP -> MinP."""
    for name, scores in logit_sets(tiny[0]).items():
        expected = warped(scores, **settings)
        for ways in (2, 16):
            got = ours(scores, ways=ways, **settings)
            kept_expected, kept_got = torch.isfinite(expected), torch.isfinite(got)
            assert torch.equal(kept_got, kept_expected), f"{name}, ways={ways}: kept sets differ"
            assert torch.allclose(torch.softmax(got, -1), torch.softmax(expected, -1), atol=1e-6), name


def test_top_p_keeps_ties_together_where_transformers_splits_them():
    """Equal logits at the boundary: transformers' (unstable) sort keeps an arbitrary part of the tie; the
    threshold keeps all of it. The only intended difference."""
    scores = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    expected, got = warped(scores, top_p=0.6), ours(scores, top_p=0.6)
    kept_expected, kept_got = torch.isfinite(expected[0]), torch.isfinite(got[0])
    assert kept_got.tolist() == [True, True, True, True, True, False]
    assert (kept_expected <= kept_got).all() and kept_expected[0] and not kept_expected[5]


def test_top_p_threshold_is_exact_for_any_number_of_ways():
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, 1000, generator=generator) * 3, -1)
    top_p = torch.tensor([0.37])
    base = top_p_threshold(probs, top_p, ways=2)
    for ways in (4, 16, 64):
        assert torch.equal(top_p_threshold(probs, top_p, ways=ways), base)
    kept = probs >= base
    sorted_probs = torch.sort(probs, -1).values
    for row in range(8):  # kept mass = smallest suffix of the ascending order whose complement is <= 1 - top_p
        dropped = sorted_probs[row][: (~kept[row]).sum()]
        assert dropped.sum() <= 1 - 0.37 + 1e-6 < dropped.sum() + sorted_probs[row][len(dropped)] + 1e-6


def test_noise_is_uniform_deterministic_and_counter_based():
    seed, step = torch.tensor([123]), torch.tensor([4])
    noise = uniform_noise(seed, step, 64, 4096)
    assert torch.equal(noise, uniform_noise(seed, step, 64, 4096))
    assert not torch.equal(noise, uniform_noise(seed, step + 1, 64, 4096))
    assert not torch.equal(noise, uniform_noise(seed + 1, step, 64, 4096))
    assert torch.equal(noise[:8, :100], uniform_noise(seed, step, 8, 100))  # a pure function of (row, token)
    assert 0 < noise.min() and noise.max() < 1
    assert stats.kstest(noise.flatten()[:50_000].double().numpy(), "uniform").pvalue > 1e-3
    assert abs(torch.corrcoef(torch.stack([noise[0], noise[1]]))[0, 1]) < 0.05


@pytest.mark.parametrize("vocab", [7, 2048, 2049, 10_000], ids=str)
def test_first_argmax_equals_argmax_ties_and_infinities_included(vocab):
    generator = torch.Generator().manual_seed(vocab)
    values = torch.randn(6, vocab, generator=generator)
    values[1] = -math.inf  # a row with nothing finite: index 0, as argmax
    values[2, :] = 1.0  # all tied: the first
    values[3, vocab // 2 :] = 5.0  # tied across pieces: the first of them
    values[4, -1] = 9.0  # the maximum in the padded last piece
    values[5] = torch.randint(0, 3, (vocab,), generator=generator).float()  # many ties in every piece
    assert torch.equal(first_argmax(values, chunk=512), values.argmax(-1))
    assert torch.equal(first_argmax(values), values.argmax(-1))


def test_unsupported_settings_are_refused_not_ignored(tiny):
    model, tokenizer = tiny
    for bad in (dict(repetition_penalty=1.1), dict(no_repeat_ngram_size=3), dict(num_beams=2, do_sample=False),
                dict(typical_p=0.9), dict(suppress_tokens=[5])):  # fmt: skip
        with pytest.raises(UnsupportedGeneration, match=next(iter(bad))):
            sampler_settings(resolved_generation_config(model, config(tokenizer, **bad)))
        assert next(iter(bad)) in unsupported_reason(model, config(tokenizer, **bad))
    model.train()
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)  # an active dropout in train mode: generate applies it
    try:
        assert "dropout" in unsupported_reason(model, config(tokenizer))
    finally:
        del model.model.layers[0].mlp.dropout
        model.eval()
    assert unsupported_reason(model, config(tokenizer)) is None


def test_model_generation_defaults_are_resolved_like_generate(tiny):
    """Unset fields come from the model's generation_config, as in generate: a repetition penalty there is refused."""
    model, tokenizer = tiny
    saved = model.generation_config.repetition_penalty
    model.generation_config.repetition_penalty = 1.3
    try:
        assert "repetition_penalty" in unsupported_reason(model, config(tokenizer, repetition_penalty=None))
        assert unsupported_reason(model, config(tokenizer, repetition_penalty=1.0)) is None
    finally:
        model.generation_config.repetition_penalty = saved


def generate_reference(model, input_ids, mask, generation):
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=mask, generation_config=generation)[:, input_ids.shape[1]:]


@pytest.mark.parametrize("steps_per_graph", [1, 4])
def test_greedy_tokens_equal_generate_with_left_padding_and_lora(tiny, steps_per_graph):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny
    input_ids, mask = left_padded(6, 9, tokenizer.pad_token_id)
    greedy = config(tokenizer, do_sample=False, max_new_tokens=13)
    engine = RolloutEngine(steps_per_graph=steps_per_graph)
    assert torch.equal(engine.generate(model, input_ids, mask, greedy).tokens, generate_reference(model, input_ids, mask, greedy))
    peft_model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"]))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)  # a trained-looking adapter, kept unmerged
    peft_model.eval()
    reference = generate_reference(peft_model, input_ids, mask, greedy)
    with peft_model.disable_adapter():
        assert not torch.equal(reference, generate_reference(peft_model, input_ids, mask, greedy)), "LoRA had no effect"
    assert torch.equal(engine.generate(peft_model, input_ids, mask, greedy).tokens, reference)

    # after a hard reset that kept the delta as frozen factors, and a new adapter trained on top (another shape)
    freeze_lora_delta(peft_model)
    reinit_adapter(peft_model, r=2, target_modules=["q_proj", "k_proj", "down_proj"], seed=1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    after_reset = generate_reference(peft_model, input_ids, mask, greedy)
    assert frozen_layers(peft_model) and not torch.equal(after_reset, reference)
    assert torch.equal(engine.generate(peft_model, input_ids, mask, greedy).tokens, after_reset)


def test_eos_padding_lengths_and_cap_follow_generate(tiny):
    """Rows stop at different steps: pad after EOS, output as wide as the longest row, stop early; caps that are not
    a multiple of the graph length and the 1-token cap."""
    model, tokenizer = tiny
    input_ids, mask = left_padded(8, 7, tokenizer.pad_token_id, seed=5)
    probe = generate_reference(model, input_ids, mask, config(tokenizer, do_sample=False, max_new_tokens=12))
    eos = sorted({int(probe[row, 1 + row % 5]) for row in range(8)})  # every row ends, at different steps
    for cap in (1, 5, 12, 30):
        greedy = config(tokenizer, do_sample=False, max_new_tokens=cap, eos_token_id=eos)
        expected = generate_reference(model, input_ids, mask, greedy)
        output = RolloutEngine(steps_per_graph=4).generate(model, input_ids, mask, greedy)
        assert torch.equal(output.tokens, expected), cap
        stops = torch.isin(expected, torch.tensor(eos))
        assert output.lengths.tolist() == [row.nonzero()[0].item() + 1 if row.any() else cap for row in stops]
    assert output.tokens.shape[1] <= 6 and len(set(output.lengths.tolist())) > 1
    assert (output.tokens == tokenizer.pad_token_id).any()
    assert output.tokens.shape[1] < output.lengths.max() + 2 * 4  # stopped within two graphs of the last EOS


def test_min_new_tokens_masks_eos(tiny):
    model, tokenizer = tiny
    input_ids, mask = left_padded(4, 7, tokenizer.pad_token_id, seed=5)
    probe = generate_reference(model, input_ids, mask, config(tokenizer, do_sample=False, max_new_tokens=6))
    greedy = config(tokenizer, do_sample=False, max_new_tokens=9, min_new_tokens=6, eos_token_id=int(probe[0, 1]))
    expected = generate_reference(model, input_ids, mask, greedy)
    assert torch.equal(RolloutEngine(steps_per_graph=4).generate(model, input_ids, mask, greedy).tokens, expected)


def frequencies(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return np.bincount(tokens.numpy(), minlength=vocab).astype(float)


def chi_square_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """One-sample chi-square, cells with expected count < 5 pooled into one."""
    expected = expected_probs * observed.sum()
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert observed[expected_probs == 0].sum() == 0, "a filtered-out token was drawn"
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    cells = (a + b) >= 10
    table = np.stack([np.append(a[cells], a[~cells].sum()), np.append(b[cells], b[~cells].sum())])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table).pvalue


def test_token_frequencies_match_generate(tiny):
    """20k rows of one prompt, two tokens each, every filter on: per-position frequencies of the engine against
    `generate`'s (two-sample chi-square) and, for the first token, against the exact warped distribution."""
    model, tokenizer = tiny
    settings = dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(2))
    input_ids, mask = prompt.expand(DRAWS, -1).contiguous(), torch.ones(DRAWS, 6, dtype=torch.long)
    sampling = config(tokenizer, max_new_tokens=2, eos_token_id=0, **settings)  # id 0 never wins: fixed lengths
    ours_tokens = RolloutEngine(steps_per_graph=1).generate(model, input_ids, mask, sampling, seed=11).tokens
    torch.manual_seed(11)
    theirs = generate_reference(model, input_ids, mask, sampling)
    with torch.no_grad():
        first_logits = model(input_ids=prompt).logits[:, -1].float()
    exact = torch.softmax(warped(first_logits, **settings), -1)[0].double().numpy()
    assert chi_square_pvalue(frequencies(ours_tokens[:, 0], vocab), exact) > 1e-3
    assert chi_square_pvalue(frequencies(theirs[:, 0], vocab), exact) > 1e-3  # the test can tell: generate passes it
    for position in (0, 1):
        assert two_sample_pvalue(frequencies(ours_tokens[:, position], vocab), frequencies(theirs[:, position], vocab)) > 1e-3
    tv = 0.5 * np.abs(frequencies(ours_tokens[:, 0], vocab) / DRAWS - exact).sum()
    assert tv < 0.05


def test_frequency_test_detects_a_wrong_distribution(tiny):
    """The check above has power: 2,000 draws at top_p=0.8 fail against top_p=0.7's distribution."""
    model, tokenizer = tiny
    prompt = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(2))
    input_ids, mask = prompt.expand(2000, -1).contiguous(), torch.ones(2000, 6, dtype=torch.long)
    wrong = RolloutEngine().generate(model, input_ids, mask, config(tokenizer, max_new_tokens=1, eos_token_id=0, top_p=0.8), seed=1)
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[:, -1].float()
    exact = torch.softmax(warped(logits, top_p=0.7), -1)[0].double().numpy()
    with pytest.raises(AssertionError):
        assert chi_square_pvalue(frequencies(wrong.tokens[:, 0], model.config.vocab_size), exact) > 1e-3


def test_same_seed_same_tokens(tiny):
    model, tokenizer = tiny
    input_ids, mask = left_padded(5, 8, tokenizer.pad_token_id)
    sampling = config(tokenizer, max_new_tokens=10, top_p=0.9)
    engine = RolloutEngine(steps_per_graph=4)
    first = engine.generate(model, input_ids, mask, sampling, seed=7).tokens
    assert torch.equal(engine.generate(model, input_ids, mask, sampling, seed=7).tokens, first)
    assert not torch.equal(engine.generate(model, input_ids, mask, sampling, seed=8).tokens, first)
    torch.manual_seed(3)
    drawn = engine.generate(model, input_ids, mask, sampling).tokens  # seed from torch's global generator
    torch.manual_seed(3)
    assert torch.equal(RolloutEngine(steps_per_graph=2).generate(model, input_ids, mask, sampling).tokens, drawn)


def test_generation_buffers_are_freed_between_generations_and_stacks_live_there(tiny):
    """The KV buffers, the decode state and the stacked projections (q/k/v's base weights with their adapters' A rows,
    gate/up's) are views of the generation arena, freed after each generation (nothing of them stays allocated beside
    training, and no parameter is moved for them), made again, with the same views, for the next, which gives the
    same tokens."""
    from peft import LoraConfig, get_peft_model

    _, tokenizer = tiny
    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    own = [parameter.data_ptr() for parameter in model.parameters()]
    input_ids, mask = left_padded(4, 8, tokenizer.pad_token_id)
    sampling = config(tokenizer, max_new_tokens=9, top_p=0.9)
    engine = RolloutEngine(steps_per_graph=4)
    first = engine.generate(model, input_ids, mask, sampling, seed=5).tokens
    arena, parts = engine._arena, engine._parts[1]
    assert not arena.held  # released: training gets the memory back
    assert all(entry is None for entry in parts.fused_qkv + parts.fused_gate_up)  # no stale view of freed memory
    stacks = [parts.stacks[f"fused_qkv.{index}"] for index in range(len(parts.layers))]
    assert all(fused.extra_rows == 8 and fused.stacked.untyped_storage().nbytes() == 0 for fused in stacks)
    gate_up = [parts.stacks[f"fused_gate_up.{index}"] for index in range(len(parts.layers))]
    assert all(fused.extra_rows == 0 and fused.stacked.untyped_storage().nbytes() == 0 for fused in gate_up)
    assert [parameter.data_ptr() for parameter in model.parameters()] == own
    from prorl_trl.rollout import arrivals

    assert all(t.untyped_storage().nbytes() for t in arrivals._ARRIVALS.values())  # no lent counter outlives it
    assert torch.equal(engine.generate(model, input_ids, mask, sampling, seed=5).tokens, first)
    assert len(arena.address) == 6  # KV, state (with the sampler's integers), flags, sampler floats, arrivals, stacks
    torch.manual_seed(0)
    reference = RolloutEngine(steps_per_graph=4).generate(build_tiny(seed=0)[0], input_ids, mask, sampling, seed=5)
    assert not torch.equal(reference.tokens, first)  # the adapters matter (else the fold is not tested)
    assert engine._arena is arena and all(parts.stacks[f"fused_qkv.{i}"] is fused for i, fused in enumerate(stacks))
    engine.release_cache = False
    engine.generate(model, input_ids, mask, sampling, seed=5)
    assert arena.held and all(entry is not None for entry in parts.fused_qkv + parts.fused_gate_up)
    stacked = parts.fused_qkv + parts.fused_gate_up
    assert all(entry.stacked.untyped_storage().data_ptr() in arena.address for entry in stacked)


def test_step_on_arena_buffers_goes_through_aot_autograd(tiny):
    """Both halves of the decode step, on the arena's KV and state views and with fold groups, trace through dynamo
    and AOT autograd (`aot_eager`: what inductor runs first, on CPU) and equal the eager step. A buffer of one dtype
    viewed as others did not: "aot_autograd() does not yet handle input mutations on views with different dtypes"
    (the forward half then ran uncompiled on the GPU)."""
    from peft import LoraConfig, get_peft_model

    from prorl_trl.rollout.engine import forward_half, select_half

    _, tokenizer = tiny
    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    input_ids, mask = left_padded(4, 8, tokenizer.pad_token_id)
    sampling = config(tokenizer, max_new_tokens=9, top_p=0.9)
    engine = RolloutEngine(steps_per_graph=4, release_cache=False)
    engine.generate(model, input_ids, mask, sampling, seed=1)
    parts, state, layout = engine._parts[1], engine._state, sampler_settings(sampling).layout
    assert all(fused is not None and fused.extra_rows for fused in parts.fused_qkv)

    keys, values = engine._caches()

    def run(forward, select):
        state.step.fill_(1)
        logits = forward(state, keys, values)
        select(logits, state, engine._sampler)
        return logits, state.out.clone(), torch.stack(keys + values)

    snapshot = [tensor.clone() for tensor in (*state, *keys, *values)]
    with torch.no_grad():
        eager = run(forward_half(parts), select_half(layout, ways=2))
        for tensor, saved in zip((*state, *keys, *values), snapshot):
            tensor.copy_(saved)
        compiled = run(torch.compile(forward_half(parts), backend="aot_eager", dynamic=False),
                       torch.compile(select_half(layout, ways=2), backend="aot_eager", dynamic=False))  # fmt: skip
    for ours, reference in zip(compiled, eager):
        torch.testing.assert_close(ours, reference)


def test_recapture_decisions(tiny, monkeypatch):
    """What would make a new CUDA graph (computed on CPU too): shapes and static settings, new parameter storage,
    LoRA state (including what the fused LoRA path reads), the A/B switches; not in-place optimizer steps,
    temperature/top_p values or new prompts of the same width budget."""
    from peft import LoraConfig, get_peft_model

    _, tokenizer = tiny
    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    input_ids, mask = left_padded(4, 8, tokenizer.pad_token_id)
    engine = RolloutEngine(steps_per_graph=4, prompt_budget=16)

    def reasons(generation, ids=input_ids, attention=mask):
        engine.generate(model, ids, attention, generation, seed=0)
        moved = "generation buffers moved"  # CPU: no pinned address
        return [r for r in engine.stats.last["capture_reasons"] if r != moved]

    base = config(tokenizer, max_new_tokens=9, top_p=0.7)
    assert reasons(base) == ["first call"]
    assert reasons(base) == []
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    assert reasons(base) == []  # in place: the graph reads the same storage
    assert reasons(config(tokenizer, max_new_tokens=9, top_p=0.9, temperature=1.2)) == []
    other_ids, other_mask = left_padded(4, 12, tokenizer.pad_token_id, seed=9)
    assert reasons(base, other_ids, other_mask) == []  # still within the prompt budget
    assert any(r.startswith("layout") for r in reasons(config(tokenizer, max_new_tokens=9, top_p=1.0)))
    assert any(r.startswith("cache_len") for r in reasons(config(tokenizer, max_new_tokens=30, top_p=1.0)))
    assert any(r.startswith("batch") for r in reasons(config(tokenizer, max_new_tokens=30, top_p=1.0), input_ids[:2], mask[:2]))
    model.merge_adapter()
    assert "LoRA state (merged, disabled, active adapter, scaling, variant, dropout or input casting)" in reasons(base)
    model.unmerge_adapter()
    reasons(base)
    query = model.get_base_model().model.layers[0].self_attn.q_proj
    query.cast_input_dtype_enabled = False  # read by lora_decode.lora_factors: part of the LoRA state
    assert "LoRA state (merged, disabled, active adapter, scaling, variant, dropout or input casting)" in reasons(base)
    query.cast_input_dtype_enabled = True
    monkeypatch.setattr(lora_decode, "FUSE_LORA", False)
    assert any(r.startswith("fuse_lora") for r in reasons(base))
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", False)
    assert any(r.startswith("fused_mlp True -> False") for r in reasons(base))
    monkeypatch.setattr(decode_attention, "LIVE_SPLITS", False)
    assert any(r.startswith("live_splits True -> False") for r in reasons(base))
    monkeypatch.setattr(sampler, "RACE_KERNEL", False)
    assert any(r.startswith("race_kernel True -> False") for r in reasons(base))
    monkeypatch.setattr(sampler, "SOFTMAX_KERNEL", False)
    assert any(r.startswith("softmax_kernel True -> False") for r in reasons(base))
    monkeypatch.setattr(lora_a_product, "A_PRODUCT_KERNEL", False)
    assert any(r.startswith("a_product_kernel True -> False") for r in reasons(base))
    monkeypatch.setattr(fused_mlp, "LORA_PRECISION", "tf32x3")
    assert any(r.startswith("lora_precision bf16x3 -> tf32x3") for r in reasons(base))
    model.delete_adapter("default")
    model.add_adapter("default", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.set_adapter("default")
    assert "parameter storage (shapes, dtypes or addresses)" in reasons(base)


@pytest.mark.parametrize("joined", [True, False], ids=["joined-with-room", "separate"])
def test_planned_resets_into_the_joined_parts_room_need_no_recapture(tiny, joined):
    """Hard resets (frozen parts, fresh adapter in place): the first adds frozen parts (a new capture); with joined
    parts and room for the next two, those write in place and the engine replays its graph; separate parts are new
    buffers at every reset (a recapture, on CUDA a recompile of ~30 s at the study's shapes)."""
    from peft import LoraConfig, get_peft_model

    from prorl_trl.reset import freeze_lora_delta, reinit_adapter

    _, tokenizer = tiny
    model = get_peft_model(build_tiny(seed=0)[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    input_ids, mask = left_padded(4, 8, tokenizer.pad_token_id)
    engine, generation = RolloutEngine(steps_per_graph=4, prompt_budget=16), config(tokenizer, max_new_tokens=9)
    storage = "parameter storage (shapes, dtypes or addresses)"

    def reset_then_reasons(reset: int) -> list[str]:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-2, generator=torch.Generator().manual_seed(reset))
        freeze_lora_delta(model, consolidate=joined, room_for=(2 - reset) if joined else 0)
        reinit_adapter(model, seed=reset)
        engine.generate(model, input_ids, mask, generation, seed=0)
        return [r for r in engine.stats.last["capture_reasons"] if r != "generation buffers moved"]

    engine.generate(model, input_ids, mask, generation, seed=0)
    assert storage in reset_then_reasons(0)
    later = [reset_then_reasons(1), reset_then_reasons(2)]
    assert later == [[], []] if joined else all(storage in reasons for reasons in later)


def run_in_triton_interpreter(code: str) -> None:
    """Run `code` in a fresh interpreter with TRITON_INTERPRET=1 (kernels on the CPU); it must print 'ok'."""
    import subprocess
    import sys

    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def run_check_in_triton_interpreter(module: str, call: str) -> None:
    """`from <module> import *; <call>` (a kernel check in tests/) under Triton's CPU interpreter; skips where numpy
    is too new for it."""
    from pathlib import Path

    if not interpreter_runs_runtime_loops():
        pytest.skip("Triton's interpreter fails on run-time loop bounds with numpy >= 2.4")
    tests = str(Path(__file__).resolve().parent)
    code = f"import sys, torch; sys.path.insert(0, {tests!r})\nfrom {module} import *\n{call}\nprint('ok')"
    run_in_triton_interpreter(code)


def interpreter_runs_runtime_loops() -> bool:
    """Triton 3.6's interpreter turns a run-time loop bound into an int via a 1-element array: numpy >= 2.4 refuses."""
    import numpy as np

    try:
        int(np.array([1]))
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (runs on the GPU machine: test_rollout_engine_gpu)")
@pytest.mark.skipif(not interpreter_runs_runtime_loops(), reason="Triton's interpreter fails on run-time loop bounds with numpy >= 2.4")
def test_triton_kernel_matches_reference_in_interpreter(monkeypatch):
    """The split-K kernel under Triton's CPU interpreter (TRITON_INTERPRET=1) against the float32 reference, with fixed
    column splits and with splits over shares of the live keys (10 splits, 100 live keys: most fixed splits idle)."""
    code = (
        "import torch\n"
        "from prorl_trl.rollout.decode_attention import gqa_decode_attention_reference\n"
        "from prorl_trl.rollout.decode_attention_triton import launch_gqa_decode\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(3, 2, 7, 200, 64, 150, 64), (2, 1, 4, 130, 32, 129, 128), (3, 2, 7, 640, 64, 100, 64)]\n"
        "for (batch, kv, groups, cache, dim, end, split), live in [(c, l) for c in cases for l in (False, True)]:\n"
        "    q = torch.randn(batch, kv * groups, 1, dim, generator=g)\n"
        "    k, v = torch.randn(2, batch, kv, cache, dim, generator=g)\n"
        "    start = torch.tensor([0, 5, 70][:batch]); stop = torch.tensor([end])\n"
        "    got = launch_gqa_decode(q, k, v, start, stop, 0.125, split, live_splits=live)\n"
        "    want = gqa_decode_attention_reference(q, k, v, start, stop, 0.125)\n"
        "    assert torch.allclose(got, want, atol=1e-5), (live, (got - want).abs().max())\n"
        "print('ok')\n"
    )
    run_in_triton_interpreter(code)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (runs on the GPU machine: test_rollout_engine_gpu)")
def test_triton_top_p_threshold_matches_reference_in_interpreter():
    """The top-p kernels under Triton's CPU interpreter against the torch search (which starts its bracket at 0, the
    kernel at target / (2 vocab) and skips a pass once the cut is found): uneven splits, peaked and uniform rows,
    top_p near 1 (no pass skipped), prefetch on and off."""
    code = (
        "import torch\n"
        "from prorl_trl.rollout.sampler import top_p_threshold_reference\n"
        "from prorl_trl.rollout.top_p_triton import launch_top_p_threshold\n"
        "from prorl_trl.rollout import top_p_triton\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(3, 5000, 3.0, 0.7, 4), (2, 2100, 0.01, 0.9, 2), (4, 3000, 8.0, 0.05, 1), (2, 2100, 0.0, 1 - 1e-6, 2)]\n"
        "for (rows, vocab, scale, top_p, splits), prefetch in [(c, f) for c in cases for f in (True, False)]:\n"
        "    top_p_triton.PREFETCH = prefetch\n"
        "    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)\n"
        "    top_p = torch.tensor([top_p])\n"
        "    got = launch_top_p_threshold(probs, top_p, splits=splits)\n"
        "    exact, target = probs.double(), 1 - float(top_p)\n"
        "    assert ((exact * (probs <= got)).sum(-1) > target - 1e-6).all() and ((exact * (probs < got)).sum(-1) <= target + 1e-6).all()\n"
        "    assert (got == top_p_threshold_reference(probs, top_p, ways=2)).float().mean() >= 0.5, (rows, vocab)\n"
        "print('ok')\n"
    )
    run_in_triton_interpreter(code)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (runs on the GPU machine: test_rollout_engine_gpu)")
def test_triton_race_matches_reference_in_interpreter():
    """The race kernel under Triton's CPU interpreter: the same uniforms (uint32 hash = the int64 torch one) and the
    same token as `race_tokens_reference`, with and without prefetching, uneven last split included."""
    code = (
        "import torch\n"
        "from prorl_trl.rollout import race_triton\n"
        "from prorl_trl.rollout.race_triton import launch_race\n"
        "from prorl_trl.rollout.sampler import race_tokens_reference, row_keys, top_p_threshold_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(5, 3000, 1.0), (3, 5000, 4.0), (4, 2049, 0.2)]\n"
        "for (rows, vocab, scale), prefetch in [(c, f) for c in cases for f in (True, False)]:\n"
        "    race_triton.PREFETCH = prefetch\n"
        "    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)\n"
        "    tau = top_p_threshold_reference(probs, torch.tensor([0.7]), ways=2)\n"
        "    keys = row_keys(torch.tensor([vocab]), torch.tensor([3]), rows)\n"
        "    best, token = launch_race(probs, tau, keys)\n"
        "    got = token.long().gather(-1, best.argmax(-1, keepdim=True))[:, 0]\n"
        "    assert torch.equal(got, race_tokens_reference(probs, tau, keys)), (rows, vocab, prefetch)\n"
        "    assert (probs.gather(-1, got[:, None]) >= tau).all()\n"
        "print('ok')\n"
    )
    run_in_triton_interpreter(code)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (runs on the GPU machine: test_rollout_engine_gpu)")
def test_triton_softmax_matches_reference_in_interpreter():
    """The softmax kernels under Triton's CPU interpreter against `softmax(scores_before_top_p(...))`: bf16 and float32
    logits, temperature, the EOS mask while too early (a dominant EOS then gets 0) and after."""
    code = (
        "import torch\n"
        "from transformers import GenerationConfig\n"
        "from prorl_trl.rollout.softmax_triton import launch_softmax\n"
        "from prorl_trl.rollout.sampler import SamplerTensors, sampler_settings, scores_before_top_p\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(3, 3000, torch.bfloat16, 5, 2), (2, 5000, torch.float32, 5, 7), (4, 2049, torch.bfloat16, 0, 0)]\n"
        "for rows, vocab, dtype, min_new, step in cases:\n"
        "    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)\n"
        "    logits[:, 7] = 20.0\n"
        "    config = GenerationConfig(do_sample=True, max_new_tokens=9, min_new_tokens=min_new, eos_token_id=[7, 11],\n"
        "                              pad_token_id=0, top_p=0.7, temperature=1.3)\n"
        "    settings = sampler_settings(config)\n"
        "    tensors = SamplerTensors.allocate(2, logits.device)\n"
        "    tensors.load(settings, seed=1)\n"
        "    step = torch.tensor([step])\n"
        "    eos = tensors.eos if settings.layout.use_min_new_tokens else tensors.eos[:0]\n"
        "    got = launch_softmax(logits, tensors.temperature, eos, step < tensors.min_new_tokens)\n"
        "    want = torch.softmax(scores_before_top_p(logits, settings.layout, tensors, step), -1)\n"
        "    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9), (got - want).abs().max()\n"
        "    assert (got[:, 7] == 0).all() == (0 < min_new and step < min_new)\n"
        "print('ok')\n"
    )
    run_in_triton_interpreter(code)


def test_race_draws_the_top_p_distribution():
    """`race_tokens_reference` over 40k rows of one distribution (each row its own key): frequencies of the kept
    tokens against transformers' top-p warped softmax (chi-square), nothing outside the nucleus drawn."""
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(1, 60, generator=generator) * 1.5
    probs = torch.softmax(scores, -1).expand(40_000, -1).contiguous()
    tau = top_p_threshold(probs, torch.tensor([0.8]))
    tokens = race_tokens(probs, tau, row_keys(torch.tensor([9]), torch.tensor([2]), probs.shape[0]))
    exact = torch.softmax(warped(scores, top_p=0.8), -1)[0].double().numpy()
    observed = np.bincount(tokens.numpy(), minlength=60).astype(float)
    assert observed[exact == 0].sum() == 0
    kept = exact > 0
    expected = exact[kept] / exact[kept].sum() * observed.sum()
    assert stats.chisquare(observed[kept], expected).pvalue > 1e-3


def test_race_and_the_scores_race_draw_the_same_token():
    """The race kernel's form (`p / E` over the nucleus) and `choose_tokens`' (`scores - log E`, removed tokens at
    -inf) from the same uniforms pick the same token (they differ only by float32 rounding of near-equal keys)."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3000, 400, generator=generator) * 2
    generation = GenerationConfig(do_sample=True, max_new_tokens=1, eos_token_id=0, pad_token_id=0, top_p=0.7, top_k=0)
    settings = sampler_settings(generation)
    tensors = SamplerTensors.allocate(1, logits.device)
    tensors.load(settings, seed=21)
    step = torch.tensor([6])
    scores = process_logits(logits, settings.layout, tensors, step)
    by_scores = choose_tokens(scores, settings.layout, tensors, step)
    probs = torch.softmax(logits, -1)
    by_race = race_tokens(probs, top_p_threshold(probs, tensors.top_p), row_keys(tensors.seed, step, logits.shape[0]))
    assert (by_race == by_scores).float().mean() >= 0.999
    assert torch.isfinite(scores.gather(-1, by_race[:, None])).all()  # never a token the filters removed


def test_reference_attention_matches_repeat_kv_sdpa():
    """The reference (the CPU path) against transformers-style attention: repeat the KV heads, masked SDPA."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 14, 1, 16, generator=generator)
    keys, values = torch.randn(2, 3, 2, 40, 16, generator=generator)
    start, end = torch.tensor([0, 4, 9]), torch.tensor([30])
    columns = torch.arange(40)
    mask = ((columns >= start[:, None]) & (columns <= end))[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(7, 1), values.repeat_interleave(7, 1), attn_mask=mask, scale=0.25
    )[:, :, 0]
    got = gqa_decode_attention_reference(query, keys, values, start, end, 0.25)
    assert torch.allclose(got, expected, atol=1e-5)
    assert math.isclose(float(got.abs().sum()), float(expected.abs().sum()), rel_tol=1e-5)


def test_default_compile_options_are_kept_only_where_inductor_knows_them(monkeypatch):
    """The engine's default inductor options (combo kernels, programmatic dependent launch) reach both compiled halves;
    a name this torch's inductor lacks is dropped (torch.compile would refuse it and the step would run uncompiled);
    callers' options win."""
    from prorl_trl.rollout import engine as engine_module

    assert RolloutEngine().compile_options == {"combo_kernels": True, "triton.enable_pdl": True}
    monkeypatch.setattr(engine_module, "DEFAULT_COMPILE_OPTIONS", {"combo_kernels": True, "no_such_option": 1})
    assert RolloutEngine().compile_options == {"combo_kernels": True}
    assert RolloutEngine(compile_options={"combo_kernels": False}).compile_options == {"combo_kernels": False}


def test_lent_arrival_counters_are_used_until_withdrawn():
    from prorl_trl.rollout import arrivals

    lent = torch.zeros(6, dtype=torch.int32)
    arrivals.lend_arrival_counters(lent)
    try:
        assert arrivals.arrival_counters(torch.device("cpu"), 6) is lent
        arrivals.withdraw_arrival_counters(torch.zeros(6, dtype=torch.int32))  # not the lent one: no effect
        assert arrivals.arrival_counters(torch.device("cpu"), 6) is lent
    finally:
        arrivals.withdraw_arrival_counters(lent)
    own = arrivals.arrival_counters(torch.device("cpu"), 6)
    assert own is not lent and own.dtype == torch.int32 and not own.any()
    assert arrivals.arrival_counters(torch.device("cpu"), 6) is own  # allocated once, then kept
