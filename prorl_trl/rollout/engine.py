"""`RolloutEngine`: a decode loop of our own, captured as CUDA graphs, for rollouts on the transformers path.

Why: `generate` costs ~5.8 ms per decode step at the seed's shapes (transformers' Python loop, the top-p sort, a host
sync per token around a ~0.5 ms graph; ../shared/notes/rollout-engine.md). Here a generation is:
1. prefill once: the model's own forward on the left-padded prompts (`decoder.prefill`), the first token sampled;
2. a fixed-shape decode step (`decoder.decode_logits` on static KV buffers + `sampler.next_tokens` + per-row EOS and
   padding bookkeeping, all on device tensors) compiled (`torch.compile`, CUDA) and captured `steps_per_graph` times
   into one CUDA graph, replayed back to back;
3. "all rows done?" read every `steps_per_graph` steps through pinned memory, one graph behind (the GPU always has the
   next graph queued), so the host never waits per token; the loop stops early once every row has finished.
It returns what `generate` returns after the prompt: `(batch, n)` tokens, the pad token after each row's EOS, `n` the
longest completion (so at most the cap).

What makes a new capture (`capture_reasons`, logged with its time): the batch size, cache length (prompt budget + cap),
the sampler's static layout, the autocast dtype, the A/B switches (`lora_decode.FUSE_LORA`, `fused_weights.FUSE_BASE`,
`fused_mlp.FUSED_MLP`, `fused_mlp.LORA_PRECISION`, `lora_epilogue.LORA_EPILOGUE` and `MIN_RANK`,
`decode_attention.LIVE_SPLITS`, `lora_decode.FOLD_LORA_A`, `lora_decode.JOIN_FROZEN`, `lora_a_product.A_PRODUCT_KERNEL`,
`sampler.RACE_KERNEL`, `sampler.SOFTMAX_KERNEL`), the model's parameter storage
(data pointers, shapes, dtypes: a LoRA rank/target change, `.data` swaps) or LoRA state (merged, disabled, active
adapter, scaling, variant, dropout, input casting), and the generation arena's layout and address
(`arena.GenerationArena`: the KV buffers, the decode state and the stacked projections, `decoder.StackGroup`, whose
base weights and A weights are copied there before every generation). The arena is freed after every generation, its
memory back to the driver, so training gets all of it back, as with `generate`, and mapped again at the same virtual
addresses for the next (`fixed_addresses`): one capture in `benchmarks/step_time.py`'s 4 trainer steps at the
Initial shape on an H100. Where the addresses do move (no virtual memory management) the graph is recaptured (~0.2 s,
no recompilation).
Optimizer steps update parameters in place: the graph reads the live storage (and the stacks' fresh copies), no
recapture. Values that change between calls (temperature, top_p, min_p, min_new_tokens, the seed, the prompts and
their padding) are copied into tensors the graph reads.

Off CUDA (or with `cuda_graphs=False`) the same step function runs eagerly, chunk by chunk: that is what the CPU
tests exercise. Dropout active in train mode is refused (generation would apply it); with every dropout at 0 the loop
runs the model in eval mode, which computes the same function, so training and evaluation share one compilation.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import torch

from . import arrivals, decode_attention, fused_mlp, fused_weights, lora_a_product, lora_decode, lora_epilogue
from . import sampler as sampler_module
from .arena import GenerationArena, Region
from .compiled import raise_recompile_limit
from .decoder import (
    DecoderParts, StackGroup, UnsupportedModel, decode_logits, decoder_parts, generation_target, load_stacks,
    plan_fusions, prefill, unload_stacks,
)  # fmt: skip
from .sampler import SamplerLayout, SamplerSettings, SamplerTensors, UnsupportedGeneration, next_tokens, sampler_settings

logger = logging.getLogger("prorl_trl")

PROMPT_ALIGN = 64  # prompt budgets grow in these steps, so nearby prompt widths share a capture
# Inductor options every compiled step gets (a caller's `compile_options` override them). `combo_kernels`: independent
# small kernels of a step run as one launch (q's and k's LoRA B products, their rotary embeddings, ...): 373 -> 317
# kernels and 17,669 -> 19,118 tokens/s at 32 x 4,096 with LoRA r32 on q,k on an H200 (commit 2ce555c's defaults;
# benchmarks/results/rollout_engine.md, section 2026-11-26 from 23:04 UTC, commit 22db721). A/B: generation.py's
# `rollout_engine@nocombo`.
# `triton.enable_pdl`: programmatic dependent launch, where the device supports it (Hopper on): an inductor kernel's
# launch overlaps the end of the previous kernel and waits on the GPU for its results (benchmarks/results/
# rollout_engine.md, section 2026-11-27 from 01:10 UTC, commit d6ff7ca). A/B: `rollout_engine@nopdl`.
DEFAULT_COMPILE_OPTIONS = {"combo_kernels": True, "triton.enable_pdl": True}


def default_compile_options() -> dict:
    """`DEFAULT_COMPILE_OPTIONS` this torch's inductor knows: `torch.compile` refuses an unknown option, and the step
    would then run uncompiled; a torch without an option just goes without it."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {name: value for name, value in DEFAULT_COMPILE_OPTIONS.items() if name in known}


class DecodeState(NamedTuple):
    """The per-row state a decode step reads and updates in place (fixed addresses: the graph's inputs), views of the
    generation arena (`state_regions`; `out` is 1-3 MiB at the recipe's shapes)."""

    token: torch.Tensor  # (batch,) the token fed to the next step
    step: torch.Tensor  # (1,) index of the token the next step chooses
    width: torch.Tensor  # (1,) padded prompt width: the first decode key goes to column `width`
    start: torch.Tensor  # (batch,) first live cache column of each row (its left padding)
    finished: torch.Tensor  # (batch,) bool: the row has emitted an EOS
    out: torch.Tensor  # (batch, columns) chosen tokens, column = step
    done: torch.Tensor  # () bool: every row finished


def state_regions(batch: int, columns: int) -> list[Region]:
    """`DecodeState` as arena regions: the integer tensors in buffer "state", the two flags in "flags" (one dtype per
    buffer). Nothing of the state stays allocated between generations (the flags' and the sampler's few bytes
    outside the arena were the engine's +5 KB of peak allocated memory over `compiled_generation` at commit 178044a)."""
    shapes = {"token": (batch,), "step": (1,), "width": (1,), "start": (batch,), "out": (batch, columns)}
    flags = {"finished": (batch,), "done": ()}
    return [*(Region(name, shape, torch.long, "state") for name, shape in shapes.items()),
            *(Region(name, shape, torch.bool, "flags") for name, shape in flags.items())]  # fmt: skip


@dataclass
class RolloutOutput:
    """`tokens`: `(batch, n)` completion tokens as `generate` returns them after the prompt; `lengths`: tokens per row
    up to and including the first EOS (the cap for rows that did not finish)."""

    tokens: torch.Tensor
    lengths: torch.Tensor


@dataclass
class EngineStats:
    """What the engine did, cumulative and for the last call (benchmarks and logs read it)."""

    generations: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    compile_error: str | None = None
    last: dict[str, Any] = field(default_factory=dict)


def unsupported_reason(model: Any, generation_config: Any) -> str | None:
    """Why the engine cannot run `model` with `generation_config` (None: it can). Cheap; no side effects."""
    try:
        decoder_parts(model)
        sampler_settings(resolved_generation_config(model, generation_config))
    except (UnsupportedModel, UnsupportedGeneration) as error:
        return str(error)
    target = generation_target(model)
    active = [
        name
        for name, module in target.named_modules()
        if module.training
        and ((isinstance(module, torch.nn.Dropout) and module.p > 0) or getattr(module, "attention_dropout", 0) > 0)
    ]
    if active:
        return f"dropout is active in train mode ({active[0]}, ...): generation would apply it"
    return None


def resolved_generation_config(model: Any, generation_config: Any) -> Any:
    """The config `generate` samples with: unset fields filled from the model's `generation_config` (transformers'
    private `_prepare_generation_config`, same in 5.17 and 5.24; guarded by tests/test_rollout_engine.py)."""
    config, _ = generation_target(model)._prepare_generation_config(generation_config)
    return config


def model_fingerprint(target: torch.nn.Module) -> tuple:
    """Everything about the model a captured graph depends on: parameter/buffer storage and LoRA layer state (all
    that `lora_decode.lora_factors` reads to choose its path, beyond the storage: variants, dropout, input casting)."""
    storage = tuple(
        (name, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        for name, tensor in chain(target.named_parameters(), target.named_buffers())
    )
    lora = tuple(
        (
            name,
            getattr(module, "merged", None),
            getattr(module, "disable_adapters", None),
            tuple(getattr(module, "active_adapters", ())),
            tuple(sorted(getattr(module, "scaling", {}).items())),
            tuple(sorted((key, type(value).__name__) for key, value in getattr(module, "lora_variant", {}).items())),
            tuple(sorted((key, repr(value)) for key, value in getattr(module, "lora_dropout", {}).items())),
            getattr(module, "cast_input_dtype_enabled", True),
            getattr(module, "fan_in_fan_out", None),
        )
        for name, module in target.named_modules()
        if hasattr(module, "lora_A")
    )
    return storage, lora


@contextmanager
def eval_mode(module: torch.nn.Module):
    """Every submodule in eval mode for the block, each one's own flag restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@dataclass(frozen=True)
class CaptureKey:
    """The shapes and static settings a captured graph (and its compilation) is specialised to."""

    device: str
    batch: int
    cache_len: int
    chunks: int
    layout: SamplerLayout
    kv_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    model: int
    cuda_graphs: bool
    fuse_lora: bool  # lora_decode.FUSE_LORA when traced (A/B benchmarks flip it)
    fuse_base: bool  # fused_weights.FUSE_BASE, likewise
    fused_mlp: bool  # fused_mlp.FUSED_MLP, likewise
    lora_precision: str  # fused_mlp.LORA_PRECISION, likewise (read at capture)
    lora_epilogue: bool  # lora_epilogue.LORA_EPILOGUE, likewise
    lora_epilogue_min_rank: int  # lora_epilogue.MIN_RANK, likewise (which groups take that kernel)
    live_splits: bool  # decode_attention.LIVE_SPLITS, likewise (read at capture)
    fold_lora_a: bool  # lora_decode.FOLD_LORA_A, likewise
    join_frozen: bool  # lora_decode.JOIN_FROZEN, likewise
    a_product_kernel: bool  # lora_a_product.A_PRODUCT_KERNEL, likewise
    race_kernel: bool  # sampler.RACE_KERNEL, likewise
    softmax_kernel: bool  # sampler.SOFTMAX_KERNEL, likewise


class CaptureRecord(NamedTuple):
    key: CaptureKey
    fingerprint: tuple  # model_fingerprint: (parameter storage, LoRA state)
    arena_layout: tuple  # GenerationArena.layout: KV, state and stack buffers
    arena_address: tuple[int, ...]  # GenerationArena.address: where each buffer starts


def capture_reasons(previous: CaptureRecord | None, current: CaptureRecord) -> list[str]:
    """Why the graph captured for `previous` cannot serve `current` (empty: replay it)."""
    if previous is None:
        return ["first call"]
    reasons = [
        f"{name} {getattr(previous.key, name)} -> {getattr(current.key, name)}"
        for name in CaptureKey.__dataclass_fields__
        if getattr(previous.key, name) != getattr(current.key, name)
    ]
    if previous.fingerprint[0] != current.fingerprint[0]:
        reasons.append("parameter storage (shapes, dtypes or addresses)")
    if previous.fingerprint[1] != current.fingerprint[1]:
        reasons.append("LoRA state (merged, disabled, active adapter, scaling, variant, dropout or input casting)")
    if previous.arena_layout != current.arena_layout:
        reasons.append("generation buffers' layout (KV, state or stacked projections)")
    elif previous.arena_address != current.arena_address:
        reasons.append("generation buffers moved")
    return reasons


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    return (tokens[..., None] == eos).any(-1)


def forward_half(parts: DecoderParts):
    """First half of a decode step: the model's logits for each row's last token (its keys/values written), in the LM
    head's dtype (the sampler reads them as float32 itself: no float32 copy between the halves)."""

    def forward(state: DecodeState, keys: tuple, values: tuple) -> torch.Tensor:
        write_index = state.width + state.step - 1
        return decode_logits(parts, state.token, state.start, write_index, list(keys), list(values), float32=False)

    return forward


def select_half(layout: SamplerLayout, ways: int):
    """Second half: choose the tokens, then per-row EOS/padding bookkeeping, all in place on device (no host reads)."""

    def select(logits: torch.Tensor, state: DecodeState, sampler: SamplerTensors) -> None:
        tokens = next_tokens(logits, layout, sampler, state.step, ways)
        tokens = torch.where(state.finished, sampler.pad, tokens)
        state.finished.logical_or_(is_eos(tokens, sampler.eos))
        state.out.index_copy_(1, state.step, tokens[:, None])
        state.token.copy_(tokens)
        state.step.add_(1)
        state.done.copy_(state.finished.all())

    return select


class DecodeStep:
    """One decode step as two separately compiled halves (`forward_half`, `select_half`).

    Each half compiles on its own, so a compiler failure in one (recorded in `errors`, full text) leaves the other
    compiled and the step still correct: the failing half runs uncompiled (the sampler then searches top-p 2-way).
    Graph breaks only split the compiled code: a CUDA graph records every kernel either way.
    """

    def __init__(
        self, parts: DecoderParts, layout: SamplerLayout, compile: bool, require_compile: bool = False,
        compile_options: dict | None = None,
    ):  # fmt: skip
        self.parts, self.layout, self.require_compile = parts, layout, require_compile
        self.errors: dict[str, str] = {}
        self.forward = forward_half(parts)
        self.select = select_half(layout, ways=16 if compile else 2)  # 16: fused passes; 2: no big temporaries
        self.compiled = compile
        if compile:
            raise_recompile_limit()
            self.forward = torch.compile(self.forward, dynamic=False, options=compile_options)
            self.select = torch.compile(self.select, dynamic=False, options=compile_options)

    def __call__(self, state: DecodeState, keys: tuple, values: tuple, sampler: SamplerTensors) -> None:
        self.select(self.forward(state, keys, values), state, sampler)

    def warm_up(self, state: DecodeState, keys: tuple, values: tuple, sampler: SamplerTensors) -> None:
        """Run once (compiling); a half that fails to compile is replaced by its eager version."""
        try:
            logits = self.forward(state, keys, values)
        except Exception as error:  # noqa: BLE001 - any compiler failure
            self._fall_back("forward", error)
            self.forward = forward_half(self.parts)
            logits = self.forward(state, keys, values)
        try:
            self.select(logits, state, sampler)
        except Exception as error:  # noqa: BLE001
            self._fall_back("select", error)
            self.select = select_half(self.layout, ways=2)
            self.select(logits, state, sampler)

    def _fall_back(self, half: str, error: Exception) -> None:
        text = f"{type(error).__name__}: {error}"
        self.errors[half] = text[-4000:]
        if self.require_compile:
            raise RuntimeError(f"torch.compile of the decode step's {half} half failed: {text[-4000:]}") from error
        logger.warning("Rollout engine: torch.compile of the decode step's %s half failed; it runs uncompiled. %s",
                       half, text[-4000:])  # fmt: skip


class RolloutEngine:
    """Generate completions with the CUDA-graph decode loop; `unsupported_reason` says when to use `generate` instead.

    Args:
        steps_per_graph: decode steps per CUDA graph (and per "all done?" check); the loop may run up to twice this
            many steps past the last row's EOS (their tokens are padding and are dropped).
        cuda_graphs: capture and replay CUDA graphs (default: on CUDA). Off: the same step runs eagerly.
        compile: `torch.compile` the step before capture (default: on CUDA). A compilation error falls back to the
            eager step (recorded in `stats.compile_error`, logged).
        prompt_budget: prompt tokens reserved in the KV cache (the trainer's `generation_max_prompt_length`), so prompt
            widths up to it share one capture. A wider batch grows the budget (one more capture).
        release_cache: free the generation arena (KV buffers, decode state, stacked projections) after each generation
            (default), so training gets the memory back; False keeps it (and the graph replayable, as
            benchmarks/generation.py's profile does).
        require_compile: raise instead of running a half of the step uncompiled when compilation fails (benchmarks).
        compile_options: inductor options for both halves of the step (`torch.compile(options=...)`), over
            `DEFAULT_COMPILE_OPTIONS`, e.g. `{"max_autotune_gemm": True}`: benchmarked GEMM choices (slower
            compilation).
    """

    def __init__(
        self,
        steps_per_graph: int = 16,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        prompt_budget: int | None = None,
        release_cache: bool = True,
        require_compile: bool = False,
        compile_options: dict | None = None,
    ):
        if steps_per_graph < 1:
            raise ValueError(f"steps_per_graph must be >= 1, got {steps_per_graph}.")
        self.steps_per_graph = steps_per_graph
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.prompt_budget = prompt_budget or 0
        self.release_cache = release_cache
        self.require_compile = require_compile
        self.compile_options = {**default_compile_options(), **(compile_options or {})}
        self.stats = EngineStats()
        self._capture_record: CaptureRecord | None = None
        self._arena: GenerationArena | None = None
        self._kv: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        self._graph: torch.cuda.CUDAGraph | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._state: DecodeState | None = None
        self._sampler: SamplerTensors | None = None
        self._parts: tuple[int, DecoderParts] | None = None
        self._steps: dict[tuple, Any] = {}

    # ------------------------------------------------------------------------------------------------ public
    def unsupported_reason(self, model: Any, generation_config: Any) -> str | None:
        return unsupported_reason(model, generation_config)

    @torch.no_grad()
    def generate(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: Any,
        seed: int | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> RolloutOutput:
        """Complete the left-padded `input_ids` as `model.generate(input_ids, attention_mask, generation_config)` would.

        `seed`: the sampler's seed (default: drawn from torch's global CPU generator, so `set_seed` makes runs
        repeatable). `autocast_dtype`: run under `torch.autocast` (also picked up from an enclosing autocast), as
        generate would inside one. Raises `UnsupportedModel` / `UnsupportedGeneration` where `unsupported_reason` says.
        """
        reason = self.unsupported_reason(model, generation_config)
        if reason is not None:
            raise UnsupportedGeneration(f"rollout engine: {reason}")
        if attention_mask.shape != input_ids.shape or input_ids.ndim != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                             "must be the same (batch, width) shape.")  # fmt: skip
        settings = sampler_settings(resolved_generation_config(model, generation_config))
        parts = self._decoder_parts(model)
        device = input_ids.device
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        if autocast_dtype is None and torch.is_autocast_enabled(device.type):
            autocast_dtype = torch.get_autocast_dtype(device.type)
        autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        use_graphs = device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        started = time.perf_counter()
        stacks: list[StackGroup] = []
        try:
            with eval_mode(parts.model), autocast:
                stacks = plan_fusions(parts)
                logits, prompt_kv = prefill(parts, input_ids, attention_mask)
                key = self._prepare(parts, settings, input_ids, prompt_kv, autocast_dtype, use_graphs, stacks)
                self._load(settings, seed, input_ids, attention_mask, prompt_kv, logits, parts)
                del prompt_kv, logits
                prefill_seconds = _elapsed(started, device)
                decode_started = time.perf_counter()
                executed, host_seconds = self._decode(settings, key, use_graphs, parts)
                output = self._finish(settings, executed)
            decode_seconds = _elapsed(decode_started, device)
        finally:
            if self.release_cache and self._arena is not None:
                unload_stacks(parts, stacks)  # their buffers are about to be freed
                arrivals.withdraw_arrival_counters(self._arena.views["arrivals"])
                self._arena.release()  # training gets the memory back; the graph is re-checked next call
        self.stats.generations += 1
        self.stats.last.update(
            batch=input_ids.shape[0], prompt_width=input_ids.shape[1], max_new_tokens=settings.max_new_tokens,
            decode_steps=executed - 1, generated=output.tokens.shape[1], prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds, host_seconds=host_seconds, cuda_graphs=use_graphs,
        )  # fmt: skip
        return output

    def time_replays(self, replays: int = 8, step: int = 1) -> dict[str, float]:
        """Diagnostics (benchmarks): replay the last graph `replays` times back to back (needs `release_cache=False`;
        it overwrites the last generation's buffers), from decode step `step` (1: a short cache; later steps attend
        over that many more keys). Returns GPU milliseconds per decode step (CUDA events) and the host milliseconds
        per step spent issuing replays."""
        if self._graph is None or self._arena is None or not self._arena.held:
            raise RuntimeError("time_replays needs a captured graph and a kept generation arena (release_cache=False).")
        columns = self._state.out.shape[1]
        if not 1 <= step <= columns - replays * self.steps_per_graph:
            raise ValueError(f"time_replays: step {step} leaves fewer than {replays} x {self.steps_per_graph} of the "
                             f"graph's {columns} output columns; pass a step from 1 to "
                             f"{columns - replays * self.steps_per_graph}.")  # fmt: skip
        self._state.step.fill_(step)
        self._state.width.fill_(self.prompt_budget)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        issued = time.perf_counter()
        begin.record()
        for _ in range(replays):
            self._graph.replay()
        end.record()
        host = time.perf_counter() - issued
        end.synchronize()
        steps = replays * self.steps_per_graph
        return {"gpu_ms_per_step": begin.elapsed_time(end) / steps, "host_ms_per_step": 1000 * host / steps}

    # ------------------------------------------------------------------------------------------------ internals
    def _decoder_parts(self, model: Any) -> DecoderParts:
        target = generation_target(model)
        if self._parts is None or self._parts[0] != id(target) or self._parts[1].model is not target:
            self._parts = (id(target), decoder_parts(model))
        return self._parts[1]

    def _prepare(self, parts, settings, input_ids, prompt_kv, autocast_dtype, use_graphs, stacks) -> CaptureKey:
        """Allocate the generation arena (KV buffers, decode state, `stacks`, copied from the live weights) and
        the sampler's tensors for this call; recapture when anything the graph depends on changed."""
        batch, width = input_ids.shape
        device = input_ids.device
        self.prompt_budget = max(self.prompt_budget, math.ceil(width / PROMPT_ALIGN) * PROMPT_ALIGN)
        chunks = math.ceil((settings.max_new_tokens - 1) / self.steps_per_graph)
        key = CaptureKey(
            device=str(device), batch=batch, cache_len=self.prompt_budget + chunks * self.steps_per_graph,
            chunks=chunks, layout=settings.layout, kv_dtype=prompt_kv[0][0].dtype, autocast_dtype=autocast_dtype,
            model=id(parts.model), cuda_graphs=use_graphs, fuse_lora=lora_decode.FUSE_LORA,
            fuse_base=fused_weights.FUSE_BASE, fused_mlp=fused_mlp.FUSED_MLP, lora_precision=fused_mlp.LORA_PRECISION,
            lora_epilogue=lora_epilogue.LORA_EPILOGUE, lora_epilogue_min_rank=lora_epilogue.MIN_RANK,
            live_splits=decode_attention.LIVE_SPLITS,
            fold_lora_a=lora_decode.FOLD_LORA_A, join_frozen=lora_decode.JOIN_FROZEN,
            a_product_kernel=lora_a_product.A_PRODUCT_KERNEL,
            race_kernel=sampler_module.RACE_KERNEL, softmax_kernel=sampler_module.SOFTMAX_KERNEL,
        )  # fmt: skip
        kv_shape = (2, len(parts.layers), batch, parts.num_kv_heads, key.cache_len, parts.head_dim)
        layout = (
            Region("kv", kv_shape, key.kv_dtype, "kv"),  # one block: per-layer buffers fared no better (commit 5cc80ba)
            *state_regions(batch, 1 + chunks * self.steps_per_graph),
            *SamplerTensors.regions(settings.layout.num_eos, integers="state", floats="sampler"),
            Region("arrivals", (batch * parts.num_kv_heads,), torch.int32, "arrivals"),  # the attention kernel's
            *(region for stack in stacks for region in stack.regions()),
        )
        if self._arena is None or self._arena.layout != layout:
            if self._arena is not None:
                self._arena.release()  # before the new one is allocated
            self._arena = GenerationArena(layout, device)
            kv = self._arena.views["kv"]
            self._kv = (tuple(kv[0].unbind(0)), tuple(kv[1].unbind(0)))
        self._arena.acquire()
        views = self._arena.views
        self._state = DecodeState(**{name: views[name] for name in DecodeState._fields})
        self._sampler = SamplerTensors.from_views(views)
        # the arena comes back uninitialised: KV columns past a row's keys are masked, but a NaN bit pattern there
        # would still poison the products; the state starts as a fresh one, the sampler as neutral values for a
        # capture's warm-up (`_load` writes the call's settings)
        for tensor in (views["kv"], views["arrivals"], *self._state):
            tensor.zero_()
        self._sampler.reset()
        arrivals.lend_arrival_counters(views["arrivals"])
        self._state.step.fill_(1)
        self._state.width.fill_(self.prompt_budget)
        load_stacks(parts, stacks, views)
        record = CaptureRecord(key, model_fingerprint(parts.model), layout, self._arena.address)
        reasons = capture_reasons(self._capture_record, record)
        self.stats.last = {"capture_reasons": reasons}
        if use_graphs and chunks > 0 and (reasons or self._graph is None):
            self._capture(parts, settings, key, reasons or ["no graph yet"])
        self._capture_record = record
        return key

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """One side stream per device for every warm-up and capture of this engine. Why: cuBLAS keeps a workspace
        (32 MiB on Hopper) per stream it has run on, for the life of the process; a new stream per capture (and
        `torch.cuda.graph`'s own capture stream) added 64 MiB of allocated memory per capture, which training saw
        as +0.06-0.16 GiB of peak (benchmarks/results/rollout_engine.md, commit 88e3468). The one stream's workspace
        then moves into the graph's pool at capture (`clear_cublas_workspaces`)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _step_function(self, parts: DecoderParts, layout: SamplerLayout, device: torch.device) -> DecodeStep:
        """The (compiled) step for this model and sampler layout, built once and reused by later captures."""
        compile_step = (device.type == "cuda") if self.compile is None else self.compile
        cache_key = (id(parts.model), layout, compile_step)
        if cache_key not in self._steps:
            self._steps[cache_key] = DecodeStep(
                parts, layout, compile_step, self.require_compile, self.compile_options
            )
        return self._steps[cache_key]

    def _caches(self) -> tuple[tuple, tuple]:
        """Per layer, the key and the value buffer (views of the arena, the same objects while it lasts)."""
        return self._kv

    def _capture(self, parts: DecoderParts, settings: SamplerSettings, key: CaptureKey, reasons: list[str]) -> None:
        started = time.perf_counter()
        self._graph = None  # frees the previous graph and its private memory pool first
        step = self._step_function(parts, settings.layout, self._state.out.device)
        keys, values = self._caches()
        self._state.step.fill_(1)
        self._state.width.fill_(self.prompt_budget)
        side = self._capture_stream(self._state.out.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles on the first call; the second settles allocations
                self._state.step.fill_(1)
                step.warm_up(self._state, keys, values, self._sampler)
        if step.errors:
            self.stats.compile_error = "; ".join(f"{half}: {text}" for half, text in step.errors.items())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # a private pool per graph (a pool shared with a deleted graph trips an assert); captured on the engine's own
        # stream, the one the warm-up ran on
        torch.cuda.synchronize()
        clear_cublas_workspaces()  # the capture's cuBLAS workspace is then allocated in the graph's pool
        try:
            with torch.cuda.graph(graph, stream=side):
                for _ in range(self.steps_per_graph):
                    step(self._state, keys, values, self._sampler)
            torch.cuda.synchronize()
        finally:
            clear_cublas_workspaces()  # ... and left there for the replays, not counted beside training
        self._graph = graph
        seconds = time.perf_counter() - started
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        self.stats.last["capture_seconds"] = seconds
        self.stats.last["capture_reason"] = ", ".join(reasons)
        logger.info("Rollout engine: captured a %d-step CUDA graph in %.1f s (batch %d, cache %d; %s).",
                    self.steps_per_graph, seconds, key.batch, key.cache_len, ", ".join(reasons))  # fmt: skip

    def _load(self, settings, seed, input_ids, attention_mask, prompt_kv, logits, parts) -> None:
        """Copy the prefill's keys/values and first tokens into the buffers the graph reads."""
        width, (keys, values) = input_ids.shape[1], self._kv
        for layer, (key, value) in enumerate(prompt_kv):
            keys[layer][:, :, :width].copy_(key)
            values[layer][:, :, :width].copy_(value)
        sampler, state = self._sampler, self._state
        sampler.load(settings, seed)
        first = next_tokens(logits, settings.layout, sampler, torch.zeros_like(state.step), ways=2)
        state.token.copy_(first)
        state.step.fill_(1)
        state.width.fill_(width)
        state.start.copy_(width - attention_mask.sum(-1))
        state.finished.copy_(is_eos(first, sampler.eos))
        state.out.fill_(settings.pad_token_id)
        state.out[:, 0] = first
        state.done.copy_(state.finished.all())

    def _decode(self, settings: SamplerSettings, key: CaptureKey, use_graphs: bool, parts: DecoderParts) -> tuple[int, float]:
        """Run decode chunks until every row finished or the cap; returns (tokens per row produced, host seconds)."""
        chunks = key.chunks
        if chunks == 0 or bool(self._state.done):
            return 1, 0.0
        host = 0.0
        if not use_graphs:
            step = self._step_function(parts, settings.layout, self._state.out.device)
            keys, values = self._caches()
            for chunk in range(chunks):
                for index in range(self.steps_per_graph):
                    (step.warm_up if chunk == index == 0 else step)(self._state, keys, values, self._sampler)
                if bool(self._state.done):
                    return 1 + (chunk + 1) * self.steps_per_graph, host
            return 1 + chunks * self.steps_per_graph, host
        flags = [torch.zeros((), dtype=torch.bool).pin_memory() for _ in range(2)]
        events = [torch.cuda.Event() for _ in range(2)]
        executed = chunks
        for chunk in range(chunks):
            issued = time.perf_counter()
            self._graph.replay()
            flags[chunk % 2].copy_(self._state.done, non_blocking=True)
            events[chunk % 2].record()
            host += time.perf_counter() - issued
            if chunk >= 1:
                events[(chunk - 1) % 2].synchronize()
                if bool(flags[(chunk - 1) % 2]):
                    executed = chunk + 1
                    break
        return 1 + executed * self.steps_per_graph, host

    def _finish(self, settings: SamplerSettings, executed: int) -> RolloutOutput:
        produced = min(executed, settings.max_new_tokens)
        tokens = self._state.out[:, :produced]
        eos = is_eos(tokens, self._sampler.eos)
        lengths = torch.where(eos.any(-1), eos.int().argmax(-1) + 1, produced)
        longest = int(lengths.max())
        return RolloutOutput(tokens=tokens[:, :longest].clone(), lengths=lengths)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's per-stream workspaces (torch makes a new one at a stream's next GEMM).

    Why, around a capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ran on, for the life of the
    process. Cleared before the capture, the capture stream's workspace is allocated inside the graph's private pool,
    which the replays use; cleared after, the pool keeps it and nothing else counts it, so training runs beside 32 MiB
    less allocated memory (benchmarks/results/rollout_engine.md, commit cb9bd0d). Inductor's CUDA-graph trees, what
    `compiled_generation` runs, clear around their captures the same way. A no-op where torch lacks the hook (CPU).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _elapsed(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
