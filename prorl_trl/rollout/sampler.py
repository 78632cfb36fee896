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
  `softmax(scores)_j`, the distribution `multinomial` draws from. The noise is counter-based (a 32-bit key per
  (seed, step, row) from SplitMix64, then a 32-bit Weyl step per token id and a finaliser), so it needs no generator
  state: CUDA-graph replays draw fresh numbers, the same seed gives the same tokens on every path (eager, compiled,
  graph), and a row's tokens do not depend on the other rows. Uniforms have 23 random bits (like
  `torch.multinomial`'s float32 draw, tokens far below 2^-24 relative probability are effectively never drawn).
* On CUDA with Triton, sampling after top-p (no top-k, no min-p: the recipes' settings) runs as kernels: the softmax
  from the logits in their own dtype (`softmax_triton`), the top-p search (`top_p_triton`), and the race over the
  probabilities (`race_triton`): `argmax p_j / E_j` over the kept tokens, the same draw up to float32 rounding of the
  keys (a monotone transform of `scores_j - log(E_j)`), from the same uniforms. Without top-p (top_p 1.0), the race
  runs on the logits in one kernel (`race_triton`'s `_logits_race_kernel`): `scores_j - log(E_j)` as the torch ops
  compute it.

Values that may change between calls without a new CUDA graph (temperature, top_p, min_p, min_new_tokens, the seed)
live in device tensors (`SamplerTensors`); what changes the captured program (greedy or not, top-k's k, whether top-p,
min-p, min_new_tokens are on, the number of EOS ids) is the `SamplerLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .arena import Region
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
_MASK32 = 0xFFFFFFFF
_WEYL32 = 0x9E3779B9  # a token id steps the 32-bit hash input by the golden-ratio increment
# the same residue mod 2^32 as an int32 constant: compiled kernels index in int32, and a constant times an index that
# does not fit int32 fails to compile
_WEYL32_INT32 = _WEYL32 - (1 << 32)
# 32-bit finaliser (C. Wellons' hash prospector, [16 21f0aaad 15 735a2d97 15]): both multipliers below 2^31, so the
# torch version's int64 products never overflow; `race_triton` computes the same in uint32
_MIX32 = ((16, 0x21F0AAAD), (15, 0x735A2D97), (15, None))
_FLOAT32_ONE_BITS = 0x3F800000
# Sampling after top-p on CUDA runs `race_triton`'s kernel (`race_tokens`), and sampling without top-p its race on the
# logits (`logits_race_tokens`); False only for the A/B (torch ops, compiled). Read when the step is traced, so part of
# the engine's capture key.
RACE_KERNEL = True
# The softmax before top-p (from the model's logits, EOS mask and temperature included) runs `softmax_triton`'s
# kernels on CUDA; False only for the A/B. Read when the step is traced, so part of the engine's capture key.
SOFTMAX_KERNEL = True
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


_SAMPLER_DTYPES = (torch.float32, torch.float32, torch.float32, torch.long, torch.long, torch.long, torch.long)


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
        """Tensors of their own (outside an arena), holding `reset`'s neutral values."""
        tensors = cls.from_views({region.name: torch.empty(region.shape, dtype=region.dtype, device=device)
                                  for region in cls.regions(num_eos, integers="", floats="")})  # fmt: skip
        tensors.reset()
        return tensors

    def reset(self) -> None:
        """Neutral values (temperature and top_p 1, the rest 0), for a capture's warm-up before `load`."""
        for tensor in self:
            tensor.zero_()
        self.temperature.fill_(1.0)
        self.top_p.fill_(1.0)

    @classmethod
    def regions(cls, num_eos: int, integers: str, floats: str) -> list[Region]:
        """The tensors as regions of a generation arena (`arena.GenerationArena`): the int64 ones in buffer
        `integers`, the float32 ones in `floats`; `from_views` makes the tuple. `load` writes every one of them."""
        shapes = {"eos": (num_eos,)}
        return [Region(f"sampler.{name}", shapes.get(name, (1,)), dtype, integers if dtype == torch.long else floats)
                for name, dtype in zip(cls._fields, _SAMPLER_DTYPES, strict=True)]  # fmt: skip

    @classmethod
    def from_views(cls, views: Mapping[str, torch.Tensor]) -> SamplerTensors:
        return cls(*(views[f"sampler.{name}"] for name in cls._fields))

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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    for shift, multiplier in _MIX32:
        x = x ^ (x >> shift)
        if multiplier is not None:
            x = (x * multiplier) & _MASK32
    return x


def row_keys(seed: torch.Tensor, step: torch.Tensor, rows: int) -> torch.Tensor:
    """`(rows,)` int64 32-bit keys, one per (seed, step, row): SplitMix64 of each, its low half.

    Row ids enter by addition only (compiled kernels index in int32: a 64-bit constant times an index does not
    compile), each followed by the SplitMix64 finaliser."""
    row_ids = torch.arange(rows, device=seed.device, dtype=torch.long)
    return _mix64(_mix64(seed + step * _SPLITMIX_GAMMA) + row_ids) & _MASK32


def noise_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`(rows, vocab)` float32 uniforms in (0, 1) from `row_keys`: a Weyl step per token id, then `_mix32`."""
    token_ids = torch.arange(vocab, device=keys.device, dtype=torch.long)
    hashed = _mix32((token_ids[None, :] * _WEYL32_INT32 + keys[:, None]) & _MASK32)
    return ((hashed >> 9).to(torch.float32) * 2 + 1) * 2.0**-24  # 23 bits, odd multiples of 2^-24: never 0 or 1


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """`(rows, vocab)` float32 uniforms in (0, 1), a pure function of (seed, step, row, token id).

    32-bit per token (a 64-bit hash per token was the largest part of the sampler's GPU time); distinct token ids of
    a row get distinct hash inputs, and rows get independent 32-bit keys."""
    return noise_from_keys(row_keys(seed, step, rows), vocab)


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


def scores_before_top_p(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor
) -> torch.Tensor:
    """`process_logits`' first part: float32 scores after min_new_tokens, and when sampling temperature and top-k."""
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
    return scores


def process_logits(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor, ways: int = 16
) -> torch.Tensor:
    """transformers' processors and warpers for one step: float32 `(rows, vocab)` scores, removed tokens at -inf.

    `step` is the index of the token being chosen (0 for the first new token).
    """
    scores = scores_before_top_p(logits, layout, tensors, step)
    if not layout.do_sample:
        return scores
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


def sampling_probabilities(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor
) -> torch.Tensor:
    """`softmax(scores_before_top_p(...))` when sampling without top-k: on CUDA `softmax_triton`'s kernels, which read
    the logits in their own dtype (no float32 copy of them first)."""
    if SOFTMAX_KERNEL and layout.do_sample and not layout.top_k and logits.is_cuda and triton_available():
        eos, too_early = eos_mask(layout, tensors, step)
        return torch.ops.prorl_rollout.softmax(logits.contiguous(), tensors.temperature, eos, too_early)
    return torch.softmax(scores_before_top_p(logits, layout, tensors, step), dim=-1)


def eos_mask(layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler kernels' EOS mask: the EOS ids (empty where min_new_tokens is off: no mask compiled in) and whether
    `step` is still too early for them."""
    return (tensors.eos if layout.use_min_new_tokens else tensors.eos[:0]), step < tensors.min_new_tokens


@torch.library.custom_op("prorl_rollout::softmax", mutates_args=())
def _softmax_op(
    logits: torch.Tensor, temperature: torch.Tensor, eos: torch.Tensor, too_early: torch.Tensor
) -> torch.Tensor:
    """Opaque to torch.compile; two launches recorded into the CUDA graph."""
    from .softmax_triton import launch_softmax

    return launch_softmax(logits, temperature, eos, too_early)


@_softmax_op.register_fake
def _(logits, temperature, eos, too_early):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def uses_race_kernel(logits: torch.Tensor, layout: SamplerLayout) -> bool:
    """Whether `next_tokens` samples through `race_triton` (sampling after top-p alone, on CUDA with Triton)."""
    return (
        RACE_KERNEL and layout.do_sample and layout.use_top_p and not layout.top_k and not layout.use_min_p
        and logits.is_cuda and triton_available()
    )  # fmt: skip


def race_tokens(probs: torch.Tensor, tau: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row `argmax_j p_j / E_j` over `p_j >= tau` (the first on ties), `E = -log(noise_from_keys(keys))`."""
    if probs.is_cuda and triton_available():
        return race_winner(*torch.ops.prorl_rollout.race(probs.contiguous(), tau, keys))
    return race_tokens_reference(probs, tau, keys)


def race_winner(best_key: torch.Tensor, best_token: torch.Tensor) -> torch.Tensor:
    """Per row the token of the first split holding the row's best key (the race kernels' `(rows, splits)` results)."""
    return best_token.gather(-1, best_key.argmax(-1, keepdim=True))[:, 0].long()


def _race_results_like(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The race kernels' outputs for `(rows, vocab)` scores, shapes only (their ops' fake implementation)."""
    from .race_triton import splits_for

    splits = splits_for(*scores.shape)
    best_key = scores.new_empty(scores.shape[0], splits, dtype=torch.float32)
    return best_key, best_key.new_empty(best_key.shape, dtype=torch.int32)


def race_tokens_reference(probs: torch.Tensor, tau: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`race_tokens` in torch ops (the kernel's reference)."""
    exponential = -torch.log(noise_from_keys(keys, probs.shape[-1]))
    return (torch.where((probs >= tau) & (probs > 0), probs / exponential, -1.0)).argmax(-1)


@torch.library.custom_op("prorl_rollout::race", mutates_args=())
def _race_op(probs: torch.Tensor, tau: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque to torch.compile; one launch recorded into the CUDA graph."""
    from .race_triton import launch_race

    return launch_race(probs, tau, keys)


@_race_op.register_fake
def _(probs, tau, keys):
    return _race_results_like(probs)


def uses_logits_race(logits: torch.Tensor, layout: SamplerLayout) -> bool:
    """Whether `next_tokens` samples through `race_triton`'s race on the logits (sampling with no top-p, top-k or
    min-p, on CUDA with Triton)."""
    return (
        RACE_KERNEL and layout.do_sample and not layout.use_top_p and not layout.top_k and not layout.use_min_p
        and logits.is_cuda and triton_available()
    )  # fmt: skip


def logits_race_tokens(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor
) -> torch.Tensor:
    """`choose_tokens(process_logits(...))` for sampling without top-p, top-k or min-p, as one kernel on the logits in
    their own dtype: `argmax scores - log(E)` from the same uniforms (`race_triton.launch_logits_race`)."""
    keys = row_keys(tensors.seed, step, logits.shape[0])
    return race_winner(*torch.ops.prorl_rollout.logits_race(logits.contiguous(), tensors.temperature,
                                                             *eos_mask(layout, tensors, step), keys))  # fmt: skip


@torch.library.custom_op("prorl_rollout::logits_race", mutates_args=())
def _logits_race_op(
    logits: torch.Tensor, temperature: torch.Tensor, eos: torch.Tensor, too_early: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque to torch.compile; one launch recorded into the CUDA graph."""
    from .race_triton import launch_logits_race

    return launch_logits_race(logits, temperature, eos, too_early, keys)


@_logits_race_op.register_fake
def _(logits, temperature, eos, too_early, keys):
    return _race_results_like(logits)


def choose_tokens(scores: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor) -> torch.Tensor:
    """One token per row from processed scores: argmax (greedy) or the exponential race (sampling)."""
    if not layout.do_sample:
        return first_argmax(scores)
    exponential = -torch.log(uniform_noise(tensors.seed, step, scores.shape[0], scores.shape[1]))
    return first_argmax(scores - torch.log(exponential))


def next_tokens(
    logits: torch.Tensor, layout: SamplerLayout, tensors: SamplerTensors, step: torch.Tensor, ways: int = 16
) -> torch.Tensor:
    """`process_logits` then `choose_tokens`: the token each row emits at `step` (before EOS/padding bookkeeping);
    after top-p alone on CUDA, the same draw through `race_tokens` (no masked copy of the scores), and without any
    filter through `logits_race_tokens` (one kernel on the logits)."""
    if uses_race_kernel(logits, layout):
        probs = sampling_probabilities(logits, layout, tensors, step)
        tau = top_p_threshold(probs, tensors.top_p, ways)
        return race_tokens(probs, tau, row_keys(tensors.seed, step, probs.shape[0]))
    if uses_logits_race(logits, layout):
        return logits_race_tokens(logits, layout, tensors, step)
    return choose_tokens(process_logits(logits, layout, tensors, step, ways), layout, tensors, step)
