"""Tiny Qwen2-architecture model and matching fast tokenizer, built in-process.

Tests, the offline demo and CPU benchmarks need a real `transformers` causal LM and a real fast tokenizer, but
nothing may be downloaded. This module builds both locally and deterministically: a byte-level tokenizer
(one token per byte, the tags our rewards look for as single tokens, and Qwen-style chat special tokens) and a small
random `Qwen2ForCausalLM`. Both save and load with `save_pretrained` / `from_pretrained` like any hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CHAT_SPECIAL_TOKENS = ["<|im_start|>"]

# Multi-character pieces our rewards and prompts use often; as single tokens they keep tiny completions short.
WORD_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "####"]

# A Qwen2-style chat template, so conversational datasets work with the tiny tokenizer exactly as with Qwen.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2's table), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return [mapping[byte] for byte in range(256)]


def tiny_vocab() -> dict[str, int]:
    """The base vocabulary: special tokens first, then one token per byte (ids 3..258)."""
    tokens = [PAD_TOKEN, EOS_TOKEN, *CHAT_SPECIAL_TOKENS, *_byte_alphabet()]
    return {token: index for index, token in enumerate(tokens)}


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges (one token per byte), Qwen2's pre-tokenizer and chat template.

    It is a real `Qwen2Tokenizer`, so `AutoTokenizer.from_pretrained` on a saved copy rebuilds exactly the same
    tokenizer, and any text round-trips (no unknown token: non-ASCII text becomes several byte tokens).
    `WORD_TOKENS` are added tokens, so `\\boxed{` or `<answer>` is one id. `eos_token` is `<|im_end|>` (it ends
    both chat turns and plain completions); `pad_token` is `<|endoftext|>`.
    """
    tokenizer = Qwen2Tokenizer(
        vocab=tiny_vocab(),
        merges=[],
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=CHAT_SPECIAL_TOKENS,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.add_tokens(WORD_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
) -> Qwen2Config:
    """A Qwen2 config sized for CPU tests; the head is untied (as in Qwen2 >= 1.5B) so TRL's fused head applies."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs
) -> Qwen2ForCausalLM:
    """A randomly initialised tiny `Qwen2ForCausalLM`; the same seed gives bit-identical weights.

    `config_kwargs` go to `tiny_config` (e.g. `hidden_size=256, num_hidden_layers=4` for a demo-sized model).
    The global RNG state is left untouched.
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = tiny_config(tokenizer, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.to(dtype)


def build_tiny(seed: int = 0, **config_kwargs) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """`(model, tokenizer)`: the pair most tests start from."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, seed=seed, **config_kwargs), tokenizer


def save_tiny(path: str | Path, seed: int = 0, **config_kwargs) -> Path:
    """Build the tiny pair and save both to `path`, loadable with `from_pretrained(path)`; returns `path`."""
    path = Path(path)
    model, tokenizer = build_tiny(seed=seed, **config_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
