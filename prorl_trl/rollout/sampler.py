"""Token selection inside the decode loop: transformers' sampling distribution with no vocabulary sort and no host sync.

What `GenerationMixin._sample` (transformers 5.x) does per step, and how this module matches it:
* logits -> float32 -> `MinNewTokensLengthLogitsProcessor` (EOS at -inf while fewer than `min_new_tokens` tokens are
  out) -> warpers in `_get_logits_processor`'s order: temperature (`scores / T`), top-k (keep every score >= the k-th
  largest, ties included), top-p (ascending sort, keep tokens whose cumulative mass *up to and including them* exceeds
  `1 - top_p`, the most likely token always), min-p (keep `p >= min_p * p_max` of the softmax after the previous
  filters) -> `softmax` -> `torch.multinomial`. Greedy (`do_sample=False`) is `argmax` after the processors only.
* Here top-p finds the same cut without sorting: the kept set is `{p >= tau}` where `tau` is the smallest float with
  `sum(p_i <= tau) > 1 - top_p`, found by an exact search over float32 bit patterns (`top_p_threshold`). Only ties
  exactly at the boundary can differ (transformers' unstable sort splits them; here they stay together).
* Sampling is the exponential race: `argmax(scores - log(E))`, `E ~ Exp(1)` i.i.d., picks token j with probability
  `softmax(scores)_j`, the distribution `multinomial` draws from. The noise is counter-based (a SplitMix64 hash of
  seed, step, row and token id), so it needs no generator state: CUDA-graph replays draw fresh numbers, the same seed
  gives the same tokens on every path (eager, compiled, graph), and a row's tokens do not depend on the other rows.
  Uniforms have 23 random bits (like `torch.multinomial`'s float32 draw, tokens far below 2^-24 relative probability
  are effectively never drawn).

Values that may change between calls without a new CUDA graph (temperature, top_p, min_p, min_new_tokens, the seed)
live in device tensors (`SamplerTensors`); what changes the captured program (greedy or not, top-k's k, whether top-p,
min-p, min_new_tokens are on, the number of EOS ids) is the `SamplerLayout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .decode_attention import triton_available

# GenerationConfig fields that add a logits processor, stopping criterion or decoding mode this loop does not
# implement, with the value(s) that mean "off". Anything else set makes `sampler_settings` refuse (the caller then
# uses `generate`), so no setting is silently ignored.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "penalty_alpha": (None,),
    "guidance_scale": (None, 1, 1.0),
    "sequence_bias": (None,),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "top_h": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "watermarking_config": (None,),
    "max_time": (None,),
    "stop_strings": (None,),
    "num_return_sequences": (None, 1),
    "prompt_lookup_num_tokens": (None,),
    "assistant_early_exit": (None,),
    "output_scores": (None, False),
    "output_logits": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "return_dict_in_generate": (None, False),
    "use_cache": (None, True),
}
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_SPLITMIX_MUL2 = 0x94D049BB133111EB - (1 << 64)
_FLOAT32_ONE_BITS = 0x3F800000
ARGMAX_CHUNK = 2048  # columns per program of `first_argmax` (75 pieces a row for Qwen's 151,936 tokens)


class UnsupportedGeneration(ValueError):
    """A generation setting the decode loop does not implement; the caller falls back to `generate`."""


@dataclass(frozen=True)
class SamplerLayout:
    """The static part of the sampler: a change needs a new CUDA graph (and a new compilation)."""

    do_sample: bool
    top_k: int  # 0: off
    use_top_p: bool
    use_min_p: bool
    use_min_new_tokens: bool
    num_eos: int


@dataclass(frozen=True)
class SamplerSettings:
    """Everything the loop needs from a (resolved) `GenerationConfig`."""

    layout: SamplerLayout
    temperature: float
    top_p: float
    min_p: float
    min_new_tokens: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def sampler_settings(config: Any) -> SamplerSettings:
    """Read a resolved `GenerationConfig` (after `model._prepare_generation_config`); raises `UnsupportedGeneration`.

    Resolved means: the model's own generation defaults already filled in, as `generate` does before sampling.
    """
    problems = [
        f"{name}={getattr(config, name)!r}"
        for name, neutral in NEUTRAL_VALUES.items()
        if getattr(config, name, None) not in neutral
    ]
    if problems:
        raise UnsupportedGeneration(f"settings the rollout engine does not implement: {', '.join(problems)}")
    if config.max_new_tokens is None or config.max_new_tokens < 1:
        raise UnsupportedGeneration(f"needs max_new_tokens >= 1, got {config.max_new_tokens!r}")
    eos = config.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)
    if not eos_ids:
        raise UnsupportedGeneration("no eos_token_id in the generation config")
    pad = config.pad_token_id if config.pad_token_id is not None else eos_ids[0]  # generate's own fallback
    do_sample = bool(config.do_sample)
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = int(config.top_k or 0)
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    min_p = config.min_p
    if do_sample and not temperature > 0:
        raise UnsupportedGeneration(f"temperature must be > 0 when sampling, got {temperature}")
    if not 0 < top_p <= 1:
        raise UnsupportedGeneration(f"top_p must be in (0, 1], got {top_p}")
    min_new_tokens = int(config.min_new_tokens or 0)
    layout = SamplerLayout(
        do_sample=do_sample,
        top_k=top_k if do_sample else 0,
        use_top_p=do_sample and top_p < 1.0,
        use_min_p=do_sample and min_p is not None,
        use_min_new_tokens=min_new_tokens > 0,
        num_eos=len(eos_ids),
    )
    return SamplerSettings(
        layout=layout,
        temperature=temperature,
        top_p=top_p,
        min_p=float(min_p) if min_p is not None else 0.0,
        min_new_tokens=min_new_tokens,
        max_new_tokens=int(config.max_new_tokens),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
    )


class SamplerTensors(NamedTuple):
    """Device copies of the values a CUDA graph reads at replay (changing them needs no recapture)."""

    temperature: torch.Tensor  # (1,) float32
    top_p: torch.Tensor  # (1,) float32
    min_p: torch.Tensor  # (1,) float32
    min_new_tokens: torch.Tensor  # (1,) int64
    eos: torch.Tensor  # (num_eos,) int64
    pad: torch.Tensor  # (1,) int64
    seed: torch.Tensor  # (1,) int64

    @classmethod
    def allocate(cls, num_eos: int, device: torch.device) -> SamplerTensors:
        floats = {"dtype": torch.float32, "device": device}
        longs = {"dtype": torch.long, "device": device}
        return cls(torch.ones(1, **floats), torch.ones(1, **floats), torch.zeros(1, **floats), torch.zeros(1, **longs),
                   torch.zeros(num_eos, **longs), torch.zeros(1, **longs), torch.zeros(1, **longs))  # fmt: skip

    def load(self, settings: SamplerSettings, seed: int) -> None:
        """Copy `settings` and `seed` into the tensors in place (the captured graph keeps their addresses)."""
        values = (
            [settings.temperature], [settings.top_p], [settings.min_p], [settings.min_new_tokens],
            list(settings.eos_token_ids), [settings.pad_token_id], [seed],
        )  # fmt: skip
        for target, value in zip(self, values, strict=True):
            target.copy_(torch.tensor(value, dtype=target.dtype))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping multiplication)."""
    z = (z ^ _shift_right(z, 30)) * _SPLITMIX_MUL1
    z = (z ^ _shift_right(z, 27)) * _SPLITMIX_MUL2
    return z ^ _shift_right(z, 31)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """`(rows, vocab)` float32 uniforms in (0, 1), a pure function of (seed, step, row, token id).

    Row and token ids enter by addition only (compiled kernels index in int32: a 64-bit constant times an index
    does not compile), each followed by the SplitMix64 finaliser; the last value is mixed twice.
    """
    device = seed.device
    row_ids = torch.arange(rows, device=device, dtype=torch.long)
    token_ids = torch.arange(vocab, device=device, dtype=torch.long)
    row_keys = _mix64(_mix64(seed + step * _SPLITMIX_GAMMA) + row_ids) * _SPLITMIX_GAMMA  # distinct odd-spaced keys
    bits = _shift_right(_mix64(_mix64(row_keys[:, None] + token_ids[None, :])), 41)  # 23 random bits
    return (bits.to(torch.float32) * 2 + 1) * 2.0**-24  # odd multiples of 2^-24: exact in float32, never 0 or 1


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, ways: int = 16) -> torch.Tensor:
    """Per row, the smallest probability `tau` such that the mass of tokens with `p <= tau` exceeds `1 - top_p`.

    Keeping `p >= tau` is transformers' `TopPLogitsWarper` cut. The search runs over float32 bit patterns of
    [0, 1] (monotone for non-negative floats): `ways - 1` candidate thresholds per pass, each pass shrinking the
    bracket `ways`-fold, until it is one bit pattern wide, so the result does not depend on `ways`. On CUDA with
    Triton it runs as `top_p_triton`'s kernels (16 ways, one read of the probabilities per pass); elsewhere as torch
    ops (`ways` 2 on CPU: no `(rows, ways, vocab)` temporaries). Returns `(rows, 1)`, never above the row's max.
    """
    if probs.is_cuda and probs.dtype == torch.float32 and triton_available():
        return torch.ops.prorl_rollout.top_p_threshold(probs.contiguous(), top_p)
    return top_p_threshold_reference(probs, top_p, ways)


@torch.library.custom_op("prorl_rollout::top_p_threshold", mutates_args=())
def _top_p_threshold_op(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Opaque to torch.compile; its launches are recorded into the CUDA graph like any other kernel."""
    from .top_p_triton import launch_top_p_threshold

    return launch_top_p_threshold(probs, top_p)


@_top_p_threshold_op.register_fake
def _(probs, top_p):
    return probs.new_empty(probs.shape[0], 1)


def top_p_threshold_reference(probs: torch.Tensor, top_p: torch.Tensor, ways: int = 16) -> torch.Tensor:
    """`top_p_threshold` in torch ops: the CPU path and the reference the kernel is tested against."""
    rows = probs.shape[0]
    target = 1.0 - top_p  # float32 tensor, as transformers compares its float32 cumsum with `1 - top_p`
    low = torch.zeros(rows, dtype=torch.long, device=probs.device)  # predicate false here (mass of p <= 0 is 0)
    high = torch.full((rows,), _FLOAT32_ONE_BITS, dtype=torch.long, device=probs.device)  # true (all the mass)
    fractions = torch.arange(1, ways, dtype=torch.long, device=probs.device)
    for _ in range(math.ceil(math.log(_FLOAT32_ONE_BITS) / math.log(ways))):
        candidates = low[:, None] + ((high - low)[:, None] * fractions) // ways  # (rows, ways - 1), ascending
        thresholds = candidates.to(torch.int32).view(torch.float32)
        below = probs[:, None, :] <= thresholds[:, :, None]
        mass = torch.where(below, probs[:, None, :], 0.0).sum(-1)
        above = mass > target
        high = torch.where(above, candidates, high[:, None]).amin(-1)
        low = torch.where(above, low[:, None], candidates).amax(-1)
    tau = high.to(torch.int32).view(torch.float32)
    return torch.minimum(tau, probs.amax(-1))[:, None]


def eos_columns(eos: torch.Tensor, vocab: int) -> torch.Tensor:
    """`(vocab,)` bool: which token ids are EOS."""
    return (torch.arange(vocab, device=eos.device)[:, None] == eos[None, :]).any(-1)


def process_logits(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor, ways: int = 16
) -> torch.Tensor:
    """transformers' processors and warpers for one step: float32 `(rows, vocab)` scores, removed tokens at -inf.

    `step` is the index of the token being chosen (0 for the first new token).
    """
    scores = logits.float()
    if layout.use_min_new_tokens:
        too_early = (step < tensors.min_new_tokens) & eos_columns(tensors.eos, scores.shape[-1])
        scores = scores.masked_fill(too_early, -math.inf)
    if not layout.do_sample:
        return scores
    scores = scores / tensors.temperature
    if layout.top_k:
        kth = torch.topk(scores, min(layout.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if layout.use_top_p:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < top_p_threshold(probs, tensors.top_p, ways), -math.inf)
    if layout.use_min_p:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < tensors.min_p * probs.amax(-1, keepdim=True), -math.inf)
    return scores


def first_argmax(values: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """`values.argmax(-1)` for `(rows, vocab)` values, the same index (the first maximum), as two reductions.

    Why: compiled, a row's argmax is one program per row, so at 32 rows the sampler's kernel (noise and masking fused
    into the argmax) kept 32 of an H100's 132 SMs busy for 0.13 ms a step. Here the row is cut into `chunk`-column
    pieces (padded with -inf), each piece's first maximum found in parallel, then the first piece holding the row's
    maximum picked: the first maximum of the piece that has the row's first maximum is the row's first maximum.
    """
    rows, vocab = values.shape
    pieces = math.ceil(vocab / chunk)
    if pieces < 2:
        return values.argmax(-1)
    padded = torch.nn.functional.pad(values, (0, pieces * chunk - vocab), value=-math.inf)
    best, where = padded.view(rows, pieces, chunk).max(-1)
    piece = best.argmax(-1, keepdim=True)
    return (piece * chunk + where.gather(-1, piece))[:, 0]


def choose_tokens(scores: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor) -> torch.Tensor:
    """One token per row from processed scores: argmax (greedy) or the exponential race (sampling)."""
    if not layout.do_sample:
        return first_argmax(scores)
    exponential = -torch.log(uniform_noise(tensors.seed, step, scores.shape[0], scores.shape[1]))
    return first_argmax(scores - torch.log(exponential))


def next_tokens(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor, ways: int = 16
) -> torch.Tensor:
    """`process_logits` then `choose_tokens`: the token each row emits at `step` (before EOS/padding bookkeeping)."""
    return choose_tokens(process_logits(logits, layout, tensors, step, ways), layout, tensors, step)
