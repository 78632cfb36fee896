import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prorl_trl.tiny import WORD_TOKENS, build_tiny, save_tiny


def test_tiny_is_deterministic_by_seed():
    a, _ = build_tiny(seed=3)
    b, _ = build_tiny(seed=3)
    c, _ = build_tiny(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_tiny_round_trips_through_save_pretrained(tmp_path):
    model, tokenizer = build_tiny(seed=1)
    save_tiny(tmp_path, seed=1)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q: 12 + 30 = ?\n<think>add</think><answer>\\boxed{42}</answer> é"
    assert loaded_tok(text).input_ids == tokenizer(text).input_ids
    assert loaded_tok.decode(tokenizer(text).input_ids) == text
    ids = torch.tensor([tokenizer(text).input_ids])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_tiny_tokenizer_has_chat_template_and_word_tokens(tiny):
    _, tokenizer = tiny
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    for token in WORD_TOKENS:
        assert len(tokenizer(token).input_ids) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tiny_build_leaves_the_global_rng_alone():
    """Building the model must not shift the caller's random stream (tests seed once and build models in between)."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny(seed=7)
    assert torch.equal(torch.rand(3), expected)
