"""Keep cuDNN's attention backward from returning NaN gradients in training (PyTorch issue 196678, TRL issue 7181).

Why: on H100/H200 PyTorch >= 2.11 runs SDPA on cuDNN by default, and its backward returns NaN in the query gradient
when a mask is passed, the sequence length is 64 mod 128 and some row's logsumexp is below about -88.7. A
left-padded GRPO batch always has such rows (its pad rows see no key), so any step whose padded length lands on 64
mod 128 can stop a run: the prolonged study lost 6 of 24 runs of 600 steps to it, deterministically for the batch
(`replay_nonfinite` named `ScaledDotProductCudnnAttentionBackward0`). The forward is right; only gradients are not.

What: `install_cudnn_attention_guard` switches a model on "sdpa" to `GUARDED_SDPA`: transformers' own SDPA forward,
except that a call which records a graph for the backward (grad mode on, an input that needs a gradient), on CUDA,
at a guarded length, runs with cuDNN taken out of the backends SDPA may choose (the others the process allows:
memory-efficient, flash, math). An SDPA backward always runs the backend its forward chose, and gradient
checkpointing's recomputation calls the attention again in grad mode at the same length, so both are covered.
Generation and the no-grad log-prob forwards keep cuDNN, and so do training calls at every other length: only the
steps whose padded length lands on a guarded remainder pay for the other kernel
(benchmarks/results/cudnn_guard.md).

Modes (`ProRLConfig.cudnn_attention_guard`):
- "auto": guard remainder 64 (the bug as reported) and any other remainder that `probe_cudnn_backward` finds
  failing: once per process and head shape, a forward and backward with cuDNN forced at lengths 128 + (0, 1, 32,
  63, 64, 65, 96, 127), on the model's head count, head size and dtype, with a left-padded causal mask as
  transformers builds it (about 1 s: each new length builds a cuDNN plan);
- "always": take cuDNN out of every training attention call (no probe);
- "off": leave the model as loaded.
The state is per process (the bug belongs to the GPU, torch and cuDNN, not to one model).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

GUARDED_SDPA = "sdpa_cudnn_guard"
CUDNN_GUARD_MODES = ("auto", "always", "off")
TILE = 128  # cuDNN's key tile: the bug sits at a half-full last tile
REPORTED_REMAINDERS = frozenset({64})  # PyTorch issue 196678: seq_len % 128 == 64
PROBE_LENGTHS = tuple(TILE + remainder for remainder in (0, 1, 32, 63, 64, 65, 96, 127))
# SDPA variants whose training path calls `guarded_sdpa_attention_forward` (the rollout's grouped-query decode
# attention, `prorl_trl.rollout.gqa_attention.GQA_DECODE_ATTENTION`, falls back to it for every non-decode call).
ROUTED_THROUGH_GUARD = frozenset({GUARDED_SDPA, "sdpa_gqa_decode"})


@dataclass(frozen=True)
class CudnnGuardReport:
    """What `install_cudnn_attention_guard` did, for the log line and the run summary."""

    mode: str
    active: bool  # whether any training attention call can be steered away from cuDNN
    every_length: bool  # "always": every training call, whatever its length
    remainders: tuple[int, ...]  # guarded lengths mod 128 ("auto")
    probe_failing: tuple[int, ...] | None  # remainders the probe saw fail; None: no probe ran
    probe_seconds: float | None
    software: str  # torch / cuDNN / GPU the decision was made on
    message: str  # the one line users see

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _GuardState:
    """The process's guard: which training SDPA calls run without cuDNN."""

    every_length = False
    remainders: frozenset[int] = frozenset()


_GUARD = _GuardState()
_PROBES: dict[tuple, tuple[tuple[int, ...] | None, float]] = {}


def guarded_length(query_length: int, key_length: int) -> bool:
    """Whether the process's guard covers an attention call of these lengths (its mode and remainders)."""
    return _GUARD.every_length or query_length % TILE in _GUARD.remainders or key_length % TILE in _GUARD.remainders


def steered_away_from_cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether this SDPA call runs without cuDNN: it records a graph for the backward, on CUDA, at a guarded length."""
    if not (_GUARD.every_length or _GUARD.remainders) or not query.is_cuda or not torch.is_grad_enabled():
        return False
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return guarded_length(query.shape[-2], key.shape[-2])


def set_guard(every_length: bool, remainders: frozenset[int] | set[int] = frozenset()) -> None:
    """Set the process's guard (`install_cudnn_attention_guard` does, from its mode and probe)."""
    _GUARD.every_length, _GUARD.remainders = every_length, frozenset(remainders)


def use_guarded_sdpa(model: Any) -> bool:
    """Switch a transformers model (or a PEFT model around one) on "sdpa" to `GUARDED_SDPA`; returns whether its
    attention now routes through the guard. The mask is "sdpa"'s, the forward transformers' own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) == "sdpa":
        AttentionInterface.register(GUARDED_SDPA, guarded_sdpa_attention_forward)
        AttentionMaskInterface.register(GUARDED_SDPA, sdpa_mask)
        base.set_attn_implementation(GUARDED_SDPA)
    return base.config._attn_implementation in ROUTED_THROUGH_GUARD


def _without_cudnn() -> contextlib.AbstractContextManager:
    """SDPA limited to the backends this process allows, less cuDNN (math when none other is on)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = [
        backend
        for backend, enabled in (
            (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        )
        if enabled
    ]
    return sdpa_kernel(allowed or [SDPBackend.MATH])


def guarded_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' `sdpa_attention_forward`, without cuDNN where `steered_away_from_cudnn` says so."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if steered_away_from_cudnn(query, key, value):
        with _without_cudnn():
            return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def left_padded_causal_mask(length: int, padding: int, device: torch.device) -> torch.Tensor:
    """The boolean mask transformers' `sdpa_mask` builds for two sequences of `length`, the first left-padded by
    `padding` tokens (its first `padding` query rows see no key), shape (2, 1, length, length), True = attend."""
    positions = torch.arange(length, device=device)
    causal = positions[:, None] >= positions[None, :]
    valid_keys = torch.ones(2, length, dtype=torch.bool, device=device)
    valid_keys[0, :padding] = False
    return causal[None, None] & valid_keys[:, None, None, :]


def _strictly_deterministic() -> bool:
    """Deterministic algorithms on, and not in warn-only mode: SDPA then never picks cuDNN for a backward."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def cudnn_cannot_run(error: BaseException) -> bool:
    """Whether a probe's error means SDPA cannot pick cuDNN for this shape or dtype here ("No available kernel", or
    no deterministic backward while deterministic algorithms are strictly on): then training attention never runs on
    it and needs no guard. Any other error (out of memory, a failed plan) must not switch the guard off."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    return "No available kernel" in str(error) or (_strictly_deterministic() and "deterministic" in str(error))


def probe_cudnn_backward(
    device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, lengths: tuple[int, ...] = PROBE_LENGTHS
) -> tuple[int, ...] | None:
    """The remainders (length mod 128) at which cuDNN's SDPA backward gives a non-finite gradient on finite inputs with
    a left-padded causal mask; None where cuDNN's SDPA cannot run (no CUDA, backend off, shape or dtype unsupported).

    Each new length makes cuDNN build a plan (~0.15 s on an H100), so the default probes the reported remainder, its
    neighbours and the tile's edges and quarters (about 1 s), not all 128 remainders (17-23 s)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    generator = torch.Generator(device=device).manual_seed(0)
    flags = []
    for length in lengths:
        shape = (2, num_heads, length, head_dim)
        query, key, value = (
            torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_() for _ in range(3)
        )
        mask = left_padded_causal_mask(length, padding=5, device=device)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), torch.enable_grad():
                output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
                grads = torch.autograd.grad(output, (query, key, value), torch.randn_like(output))
        except RuntimeError as error:
            if cudnn_cannot_run(error):
                return None
            # Anything else (out of memory on a shared GPU, a plan that failed at one length) says nothing about
            # cuDNN's answer there: that length is guarded, as one that failed.
            logger.warning("cuDNN attention probe at length %d failed (%s); guarding it.", length, error)
            flags.append(torch.tensor(True, device=device))
            continue
        flags.append(torch.stack([~torch.isfinite(grad).all() for grad in grads]).any())
    failing = torch.stack(flags).cpu().tolist()
    return tuple(sorted({length % TILE for length, bad in zip(lengths, failing) if bad}))


def _attention_shape(model: Any) -> tuple[int, int]:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _software(device: torch.device) -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    return f"torch {torch.__version__}, cuDNN {cudnn}, {gpu}"


def _probe_device(model: Any) -> torch.device:
    """The model's CUDA device, else the current CUDA device (an SFT model still on the CPU), else the CPU."""
    parameter = next(iter(model.parameters()), None)
    if parameter is not None and parameter.is_cuda:
        return parameter.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def probe_key(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> tuple:
    """What a probe's answer holds for within a process: the device, the shape, the dtype, and whether deterministic
    algorithms are on (strictly on, SDPA never picks cuDNN for a backward and the probe answers None; a trainer made
    after they are off again must probe again, or cuDNN's NaN would run unguarded)."""
    return (str(device), dtype, heads, head_dim, _strictly_deterministic())


def probe_dtype(weights: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype training attention runs in: the weights' where they are half precision, else autocast's (float16
    under `fp16`; bfloat16 where none is named). A probe in another dtype answers for other kernels."""
    low = (torch.float16, torch.bfloat16)
    return weights if weights in low else autocast_dtype if autocast_dtype in low else torch.bfloat16


def install_cudnn_attention_guard(
    model: Any, mode: str = "auto", autocast_dtype: torch.dtype | None = None
) -> CudnnGuardReport:
    """Guard `model`'s training attention against cuDNN's NaN backward as `mode` says (see the module docstring).

    `model`: a transformers model, or a PEFT model around one. `autocast_dtype`: the mixed-precision dtype training
    attention runs in over float32 weights (float16 under `fp16`), which the probe must use; bfloat16 by default.
    Switches a model on "sdpa" to `GUARDED_SDPA` (same forward; the switch is in `model.config._attn_implementation`)
    and sets this process's guard. Returns the report; its `message` is the line to show.
    """
    if mode not in CUDNN_GUARD_MODES:
        raise ValueError(f"cudnn_attention_guard must be one of {list(CUDNN_GUARD_MODES)}, got {mode!r}.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = _probe_device(base)
    software = _software(device)
    implementation = getattr(base.config, "_attn_implementation", None)

    def report(active: bool, every: bool, remainders=(), failing=None, seconds=None, why: str = "") -> CudnnGuardReport:
        return CudnnGuardReport(mode, active, every, tuple(sorted(remainders)), failing, seconds, software, why)

    if mode == "off":
        set_guard(False)
        if implementation == GUARDED_SDPA:
            base.set_attn_implementation("sdpa")
        return report(False, False, why="cuDNN attention guard off: training attention may use cuDNN at every length "
                      "(PyTorch issue 196678 can make gradients NaN on H100/H200).")  # fmt: skip
    if implementation != "sdpa" and implementation not in ROUTED_THROUGH_GUARD:
        return report(False, False, why=f"cuDNN attention guard not needed: the model's attention is "
                      f"{implementation!r}, not SDPA.")  # fmt: skip
    if device.type != "cuda":
        return report(False, False, why="cuDNN attention guard not needed: no CUDA device.")
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return report(
            False, False, why="cuDNN attention guard not needed: cuDNN's SDPA backend is off in this process."
        )
    if mode == "always":
        use_guarded_sdpa(base)
        set_guard(True)
        return report(True, True, why="cuDNN attention guard (always): every training attention call runs without "
                      "cuDNN (`cudnn_attention_guard: auto` guards only the lengths cuDNN gets wrong).")  # fmt: skip
    heads, head_dim = _attention_shape(base)
    dtype = probe_dtype(base.dtype, autocast_dtype)
    key = probe_key(device, dtype, heads, head_dim)
    if key not in _PROBES:
        started = time.perf_counter()
        _PROBES[key] = (probe_cudnn_backward(device, dtype, heads, head_dim), time.perf_counter() - started)
    failing, seconds = _PROBES[key]
    result = report_after_probe(mode, failing, seconds, software, f"{heads} heads of {head_dim}, {dtype}")
    if result.active:
        use_guarded_sdpa(base)
    set_guard(False, result.remainders)
    return result


def report_after_probe(
    mode: str, failing: tuple[int, ...] | None, seconds: float, software: str, shape: str
) -> CudnnGuardReport:
    """What "auto" does once the probe has answered: guard remainder 64 and every remainder the probe saw fail, or
    nothing where cuDNN's SDPA cannot train this shape here (`failing` None: then SDPA never picks cuDNN for it).

    A pure function of the probe's answer, so each branch is tested without a GPU."""
    if failing is None:
        why = (
            "deterministic algorithms are on (torch.use_deterministic_algorithms), which cuDNN's SDPA backward does "
            "not support"
            if torch.are_deterministic_algorithms_enabled()
            else "it does not take this shape or dtype"
        )
        return CudnnGuardReport(mode, False, False, (), None, round(seconds, 2), software,
                                f"cuDNN attention guard not needed: cuDNN's SDPA does not train {shape} here "
                                f"({software}): {why}.")  # fmt: skip
    remainders = tuple(sorted(REPORTED_REMAINDERS | set(failing)))
    found = f"found NaN gradients at {list(failing)}" if failing else "found no NaN gradient"
    return CudnnGuardReport(
        mode, True, False, remainders, tuple(failing), round(seconds, 2), software,
        f"cuDNN attention guard (auto): training attention at lengths {list(remainders)} mod {TILE} runs "
        f"without cuDNN; the start-up probe ({software}; {shape}) {found} "
        f"in {seconds:.1f} s. `cudnn_attention_guard: off` turns it off.",
    )  # fmt: skip
