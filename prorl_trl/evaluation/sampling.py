"""Sampling n completions per prompt, the same way for `prorl-trl eval` and for validation during training.

Throughput comes from batching: every (prompt, sample) pair is one row, rows are sorted by prompt length (little
padding) and `batch_size` rows go through one left-padded `generate` call, or through `prorl_trl.rollout`'s CUDA-graph
decode loop with `rollout_engine` (same distribution, several times faster on GPU). vLLM is used by `prorl-trl eval` when it
is importable (one call, `SamplingParams(n=...)`); that path cannot run on our CPU CI and is kept deliberately small.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

logger = logging.getLogger("prorl_trl")

@dataclass
class SamplingSettings:
    """How completions are drawn. Field names follow TRL's (`temperature`, `top_p`, `max_completion_length`)."""

    num_samples: int = field(default=4, metadata={"help": "Completions drawn per problem (n of pass@k)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass, in (0, 1]."})
    max_completion_length: int = field(default=256, metadata={"help": "Maximum new tokens per completion."})
    batch_size: int = field(default=64, metadata={"help": "Sequences (prompt x sample rows) per generate call."})
    seed: int = field(
        default=0, metadata={"help": "Seed of the sampler; each batch is seeded from it and the jobs it holds."}
    )
    compile: bool = field(
        default=False,
        metadata={"help": "Static KV cache + torch.compile'd decode step with fixed batch shapes (GPU; ~5x on small "
                  "models, one compilation per run)."},
    )
    rollout_engine: bool = field(
        default=False,
        metadata={"help": "Sample with prorl_trl.rollout's decode loop (CUDA graphs on GPU, fixed batch shapes, one "
                  "capture per run) instead of generate; settings it does not implement fall back to generate."},
    )

    def __post_init__(self):
        problems = []
        if self.num_samples < 1:
            problems.append(f"num_samples must be >= 1, got {self.num_samples}")
        if self.temperature <= 0:
            problems.append(f"temperature must be > 0 (sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_completion_length < 1:
            problems.append(f"max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, got {self.batch_size}")
        if problems:
            raise ValueError("Invalid sampling settings: " + "; ".join(problems) + ".")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """One sampled completion: which problem (position in the prompt list) and which of its n samples."""

    prompt_index: int
    sample_index: int
    text: str
    num_tokens: int
    finished: bool  # ended with EOS (False: cut at max_completion_length)


def is_conversational(prompt: Any) -> bool:
    """TRL's convention: a conversational prompt is a list of `{"role", "content"}` messages."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompt(prompt: Any, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The text the model continues: the chat template (with the assistant turn opened) or the plain prompt.

    `chat_template_kwargs` are passed to the template (TRL's `GRPOConfig.chat_template_kwargs`, e.g.
    `{"enable_thinking": False}`), so prompts render as in training.
    """
    if is_conversational(prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The prompts are conversational (lists of messages) but the tokenizer has no chat template; "
                "use a chat model, or a dataset with plain-text prompts."
            )
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if not isinstance(prompt, str):
        raise TypeError(f"A prompt must be a string or a list of chat messages, got {type(prompt).__name__}.")
    return prompt


def encode_prompt(prompt: Any, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids the model continues, tokenised like TRL does it for training.

    A chat-rendered prompt already holds any BOS token the template wants, so it is tokenised without special tokens
    (TRL does the same); a plain-text prompt gets the tokenizer's usual special tokens (a base model's BOS).
    """
    text = render_prompt(prompt, tokenizer, chat_template_kwargs)
    return tokenizer(text, add_special_tokens=not is_conversational(prompt))["input_ids"]


def completion_for_reward(prompt: Any, text: str) -> Any:
    """A completion in the format TRL hands reward functions: a message list for conversational prompts."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("Neither the model's generation config nor the tokenizer defines an EOS token.")
    return ids


def generation_config_for(model: Any, tokenizer: Any, settings: SamplingSettings):
    """A `GenerationConfig` with every sampling knob set explicitly.

    transformers fills unset (None) fields from the model's own `generation_config.json` (e.g. Qwen ships top_k=20,
    repetition_penalty=1.05), which would silently change what pass@k measures, so top_k/repetition_penalty are
    pinned to "off" here.
    """
    from transformers import GenerationConfig

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return GenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=settings.max_completion_length,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        num_return_sequences=1,
    )


def sample_transformers(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    settings: SamplingSettings,
    jobs: Sequence[tuple[int, int]] | None = None,
    on_batch: Callable[[list[Completion]], None] | None = None,
    progress: bool = False,
    desc: str = "sampling",
    engine: Any = None,
) -> tuple[list[Completion], dict[str, float]]:
    """Sample completions with `model.generate`; returns the completions and throughput stats.

    `prompt_ids` are tokenised prompts (`encode_prompt`). `jobs` lists the (prompt index, sample index) rows to draw
    (default: every prompt x `num_samples`); a resumed run passes only the missing ones. `on_batch` receives each
    finished batch (used to append to a samples file). The caller chooses the model's mode; this function only adds
    `torch.no_grad()`. Every batch seeds torch's generator with `batch_seed` (its jobs decide its draws). With
    `settings.rollout_engine`, batches go through `engine` (a `prorl_trl.rollout.engine.RolloutEngine`; a new one if
    None), which samples from that generator like `generate`.
    """
    if jobs is None:
        jobs = [(p, s) for p in range(len(prompt_ids)) for s in range(settings.num_samples)]
    encoded = [list(ids) for ids in prompt_ids]
    order = sorted(jobs, key=lambda job: (-len(encoded[job[0]]), job))
    config = generation_config_for(model, tokenizer, settings)
    if settings.rollout_engine:
        from prorl_trl.rollout.engine import RolloutEngine

        engine = engine or RolloutEngine()
        reason = engine.unsupported_reason(model, config)
        if reason is not None:
            logger.warning("rollout_engine: sampling with generate instead (%s).", reason)
            engine = None
    else:
        engine = None
    fixed_shapes = settings.compile or engine is not None
    # Compiled decoding recompiles (the engine recaptures) for every new shape: one width and row count for all.
    fixed_width = max((len(encoded[p]) for p, _ in order), default=0) if fixed_shapes else None
    if settings.compile and engine is None:
        from prorl_trl.rollout.compiled import enable_compiled_generation

        enable_compiled_generation(config, max_cache_len=fixed_width + settings.max_completion_length)
    eos, pad = set(config.eos_token_id), config.pad_token_id
    device = next(model.parameters()).device
    completions: list[Completion] = []
    stats = {"completions": 0, "completion_tokens": 0, "seconds": 0.0}
    batches = [order[i : i + settings.batch_size] for i in range(0, len(order), settings.batch_size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(order), desc=desc, unit="completion")
    for batch in batches:
        rows = [encoded[p] for p, _ in batch]
        if fixed_shapes:  # pad the last batch with copies of its last row; their outputs are dropped
            rows += [rows[-1]] * (min(settings.batch_size, len(order)) - len(rows))
        width = fixed_width or max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: the new tokens of every row start at the same position
            if row:
                input_ids[i, width - len(row) :] = torch.tensor(row)
                attention_mask[i, width - len(row) :] = 1
        torch.manual_seed(batch_seed(settings.seed, batch))
        start = time.perf_counter()
        with torch.no_grad():
            if engine is not None:
                output = engine.generate(model, input_ids.to(device), attention_mask.to(device), config).tokens
            else:
                output = model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
                )[:, width:]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats["seconds"] += time.perf_counter() - start
        new_tokens = output.tolist()
        finished_batch = []
        for (prompt_index, sample_index), tokens in zip(batch, new_tokens[: len(batch)]):
            cut = next((i for i, t in enumerate(tokens) if t in eos), None)
            kept = tokens if cut is None else tokens[: cut + 1]
            text = tokenizer.decode(kept, skip_special_tokens=True)
            finished_batch.append(Completion(prompt_index, sample_index, text, len(kept), cut is not None))
            stats["completion_tokens"] += len(kept)
        stats["completions"] += len(finished_batch)
        completions.extend(finished_batch)
        if on_batch is not None:
            on_batch(finished_batch)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return completions, stats


def batch_seed(seed: int, batch: Sequence[tuple[int, int]]) -> int:
    """The torch seed of one batch: a stable hash of `seed` and the (prompt index, sample index) jobs it holds.

    Seeding by the jobs rather than by the batch's position means a resumed run with a larger n (whose missing
    samples fill batches laid out like the first run's) draws new samples, not copies of samples 0..n-1; the same
    jobs with the same seed still draw the same completions.
    """
    key = json.dumps([int(seed), [[int(p), int(s)] for p, s in batch]]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA setup raising at import
        return False
    return True


def sample_vllm(
    model_path: str, prompt_ids: Sequence[list[int]], settings: SamplingSettings,
    prompt_indices: Sequence[int] | None = None, dtype: str = "auto", trust_remote_code: bool = False,
) -> tuple[list[Completion], dict[str, float]]:
    """Sample with vLLM (GPU only; not exercised by the CPU test suite). Draws all n samples of `prompt_indices`."""
    from vllm import LLM, SamplingParams

    indices = list(range(len(prompt_ids))) if prompt_indices is None else list(prompt_indices)
    # The engine-level seed makes the run reproducible; a per-request seed would give every prompt the same stream.
    llm = LLM(model=model_path, seed=settings.seed, dtype=dtype, trust_remote_code=trust_remote_code)
    params = SamplingParams(
        n=settings.num_samples, temperature=settings.temperature, top_p=settings.top_p, top_k=-1,
        max_tokens=settings.max_completion_length,
    )
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(prompt_ids[i])} for i in indices], params)
    seconds = time.perf_counter() - start
    completions = [
        Completion(p, s, out.text, len(out.token_ids), out.finish_reason == "stop")
        for p, request in zip(indices, outputs)
        for s, out in enumerate(request.outputs)
    ]
    tokens = sum(c.num_tokens for c in completions)
    del llm
    return completions, {"completions": len(completions), "completion_tokens": tokens, "seconds": seconds}
