"""Batched sampling: left padding, job bookkeeping, pinned generation settings, prompt rendering."""

import pytest
import torch

from prorl_trl.evaluation.sampling import (
    SamplingSettings,
    encode_prompt,
    generation_config_for,
    render_prompt,
    sample_transformers,
)


def test_left_padded_batches_match_unpadded_generation(tiny):
    """top_p -> 0 keeps only the most likely token, so sampling is greedy and comparable row by row."""
    model, tokenizer = tiny
    model.eval()
    texts = ["2+2=", "A much longer prompt that forces padding of the short one: 7*6="]
    settings = SamplingSettings(num_samples=2, temperature=1.0, top_p=1e-9, max_completion_length=6, batch_size=4)
    ids = [encode_prompt(text, tokenizer) for text in texts]
    completions, stats = sample_transformers(model, tokenizer, ids, settings)
    assert stats["completions"] == 4 and len(completions) == 4
    assert sorted((c.prompt_index, c.sample_index) for c in completions) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in completions:
        ids = tokenizer(texts[c.prompt_index], return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
        expected = greedy[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert c.num_tokens == len(expected) <= 6
        assert c.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert c.finished == (tokenizer.eos_token_id in expected)


def test_jobs_draw_only_the_requested_rows_and_batches_report_progress(tiny):
    model, tokenizer = tiny
    settings = SamplingSettings(num_samples=3, max_completion_length=3, batch_size=2, seed=5)
    seen = []
    prompts = [encode_prompt(text, tokenizer) for text in ["a", "bb", "ccc"]]
    completions, stats = sample_transformers(
        model, tokenizer, prompts, settings, jobs=[(2, 1), (0, 2), (1, 0)], on_batch=seen.append
    )
    assert sorted((c.prompt_index, c.sample_index) for c in completions) == [(0, 2), (1, 0), (2, 1)]
    assert [len(batch) for batch in seen] == [2, 1]
    assert stats["completion_tokens"] == sum(c.num_tokens for c in completions)
    again, _ = sample_transformers(model, tokenizer, prompts, settings, jobs=[(2, 1), (0, 2), (1, 0)])
    assert [c.text for c in again] == [c.text for c in completions]  # seeded


def test_generation_config_ignores_the_models_own_sampling_defaults(tiny):
    model, tokenizer = tiny
    model.generation_config.top_k = 20
    model.generation_config.repetition_penalty = 1.05
    config = generation_config_for(model, tokenizer, SamplingSettings(temperature=0.6, top_p=0.95, max_completion_length=9))
    assert (config.top_k, config.repetition_penalty, config.temperature, config.top_p) == (0, 1.0, 0.6, 0.95)
    assert config.max_new_tokens == 9 and config.do_sample
    assert tokenizer.eos_token_id in config.eos_token_id


def test_render_prompt_uses_the_chat_template_for_messages(tiny):
    _, tokenizer = tiny
    text = render_prompt([{"role": "user", "content": "hi"}], tokenizer)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("plain", tokenizer) == "plain"
    assert tokenizer.decode(encode_prompt([{"role": "user", "content": "hi"}], tokenizer)) == text
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_prompt([{"role": "user", "content": "hi"}], tokenizer)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_samples": 0}, "num_samples"), ({"temperature": 0}, "temperature"), ({"top_p": 1.5}, "top_p"),
     ({"max_completion_length": 0}, "max_completion_length")],
)
def test_bad_sampling_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**kwargs)


def test_fixed_shape_static_cache_path_gives_the_same_completions(tiny):
    """`compile=True` pads every batch to one width and row count (for a single compilation on GPU); on CPU
    transformers does not compile, but the static cache and the fixed-shape padding are exercised and must not
    change what is generated (greedy via top_p -> 0)."""
    model, tokenizer = tiny
    model.eval()
    prompts = [encode_prompt(text, tokenizer) for text in ["1+1=", "a longer prompt, 3*3=", "x"]]
    plain = SamplingSettings(num_samples=2, top_p=1e-9, max_completion_length=5, batch_size=4)
    fixed = SamplingSettings(num_samples=2, top_p=1e-9, max_completion_length=5, batch_size=4, compile=True)
    expected, _ = sample_transformers(model, tokenizer, prompts, plain)
    got, stats = sample_transformers(model, tokenizer, prompts, fixed)
    assert stats["completions"] == 6
    key = lambda c: (c.prompt_index, c.sample_index)  # noqa: E731
    assert [(key(c), c.text, c.num_tokens) for c in sorted(got, key=key)] == [
        (key(c), c.text, c.num_tokens) for c in sorted(expected, key=key)
    ]


def test_rollout_engine_sampling_gives_generates_completions(tiny):
    """`rollout_engine=True` (what `prorl-trl eval` and validation use on GPU) draws the same greedy completions as
    `generate` (text, lengths, finished flags), through fixed batch shapes."""
    model, tokenizer = tiny
    model.eval()
    prompts = [encode_prompt(text, tokenizer) for text in ["1+1=", "a longer prompt, 3*3=", "x"]]
    plain = SamplingSettings(num_samples=2, top_p=1e-9, max_completion_length=7, batch_size=4)
    engine = SamplingSettings(num_samples=2, top_p=1e-9, max_completion_length=7, batch_size=4, rollout_engine=True)
    expected, _ = sample_transformers(model, tokenizer, prompts, plain)
    got, stats = sample_transformers(model, tokenizer, prompts, engine)
    key = lambda c: (c.prompt_index, c.sample_index)  # noqa: E731
    as_tuples = lambda cs: [(key(c), c.text, c.num_tokens, c.finished) for c in sorted(cs, key=key)]  # noqa: E731
    assert stats["completions"] == 6 and as_tuples(got) == as_tuples(expected)
