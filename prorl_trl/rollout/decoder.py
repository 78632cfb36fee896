"""The model side of the decode loop: prefill through the model's own forward, then one-token steps on static KV buffers.

Prefill is the model's `forward` on the left-padded prompts (its own attention and masks, `logits_to_keep=1`, the
position ids `generate` computes), with a `DynamicCache` whose keys/values are then copied into the loop's buffers.
A decode step calls the model's own submodules (norms, base projections, the rotary embedding and
`apply_rotary_pos_emb` of its modeling file, the MLP's activation) in the order its decoder layer does; only
attention is replaced, by `decode_attention.gqa_decode_attention` on the static cache. That restricts the loop to
decoder-only models whose layers follow the Llama layout: `SUPPORTED_MODEL_TYPES`, full attention, a plain embedding.
Anything else is refused with a reason (the caller falls back to `generate`).

Unmerged PEFT LoRA layers no longer run their own forward here: `lora_decode.project` computes PEFT's function with
the products written as reductions, grouped by shared input (q/k/v, gate/up), which `torch.compile` turns into two
fused kernels per group instead of a GEMM plus a split-K kernel per product. LoRA layers it cannot reproduce exactly
(DoRA, several active adapters, merged, ...) are called as modules, as before.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import fused_weights
from .arena import Region
from .decode_attention import gqa_decode_attention
from .fused_weights import FusedLinear, copy_members, copyable, stack_copies
from .lora_decode import (
    LoraFactors, base_linear, fold_factors, fold_rows, frozen_joins, gated_mlp, mlp_fold_factors, project,
    refresh_folded, refresh_joined,
)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


class UnsupportedModel(ValueError):
    """A model the decode loop cannot run; the caller falls back to `generate`."""


@dataclass
class DecoderParts:
    """What a decode step calls, looked up once per model (the modules themselves, never copies of their weights)."""

    model: torch.nn.Module  # the PreTrainedModel whose forward `generate` calls (the PEFT base model for PEFT)
    embed_tokens: torch.nn.Embedding
    layers: list[torch.nn.Module]
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary_emb: torch.nn.Module
    apply_rotary: Callable
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    # per layer, the base q/k/v and gate/up projections stacked as copies in buffers held for the generation, with
    # copies of their adapters' A weights as extra rows where those fold (q/k/v, o and down; `StackGroup`); None:
    # separate GEMMs (always for o and down without adapters); set by `plan_fusions` and `load_stacks` before every
    # generation, None again after it
    fused_qkv: list[FusedLinear | None] = field(default_factory=list)
    fused_gate_up: list[FusedLinear | None] = field(default_factory=list)
    fused_o: list[FusedLinear | None] = field(default_factory=list)
    fused_down: list[FusedLinear | None] = field(default_factory=list)
    stacks: dict[str, FusedLinear] = field(default_factory=dict)  # `load_stacks`' by `StackGroup.name`, reused


def generation_target(model: Any) -> Any:
    """The module whose forward `generate` runs: a PEFT model's base model (LoRA layers live inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_parts(model: Any) -> DecoderParts:
    """Look up the decode step's modules; raises `UnsupportedModel` with the reason."""
    target = generation_target(model)
    config = getattr(target, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if getattr(config, "quantization_config", None) is not None:
        raise UnsupportedModel("quantized weights")
    if len(set(getattr(target, "hf_device_map", {"": 0}).values())) > 1:
        raise UnsupportedModel("a model split across devices (device_map)")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModel(f"layer types {sorted(set(layer_types))} (only full attention is supported)")
    backbone = getattr(target, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if backbone is None or any(not hasattr(backbone, name) for name in needed) or not hasattr(target, "lm_head"):
        raise UnsupportedModel(f"{type(target).__name__} lacks the Llama layout (model.{{{','.join(needed)}}}, lm_head)")
    if type(backbone.embed_tokens) is not torch.nn.Embedding:
        raise UnsupportedModel(f"input embedding is a {type(backbone.embed_tokens).__name__} (adapter or wrapper)")
    first = backbone.layers[0].self_attn
    if getattr(first, "sliding_window", None) is not None:
        raise UnsupportedModel("sliding-window attention")
    modeling = sys.modules[type(first).__module__]
    apply_rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply_rotary is None:
        raise UnsupportedModel(f"{modeling.__name__} has no apply_rotary_pos_emb")
    if list(inspect.signature(backbone.rotary_emb.forward).parameters)[:2] != ["x", "position_ids"]:
        raise UnsupportedModel(f"rotary embedding signature {inspect.signature(backbone.rotary_emb.forward)}")
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_heads = text_config.num_attention_heads
    return DecoderParts(
        model=target,
        embed_tokens=backbone.embed_tokens,
        layers=list(backbone.layers),
        norm=backbone.norm,
        lm_head=target.lm_head,
        rotary_emb=backbone.rotary_emb,
        apply_rotary=apply_rotary,
        num_heads=num_heads,
        num_kv_heads=text_config.num_key_value_heads or num_heads,
        head_dim=first.head_dim,
        qk_norm=hasattr(first, "q_norm"),
    )


def _attention_inputs(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attention = layer.self_attn
    return attention.q_proj, attention.k_proj, attention.v_proj


def _mlp_inputs(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return tuple(getattr(layer.mlp, name, None) for name in ("gate_proj", "up_proj"))


def _output_projection(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return (layer.self_attn.o_proj,)


def _down_projection(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    down = getattr(layer.mlp, "down_proj", None)
    return () if down is None else (down,)


# group name -> its modules in a layer, the factors whose A products fold into its stack (gate/up's only for
# `lora_a_product`'s kernel: their GEMM is `fused_mlp`'s), whether it is fused without adapters (one projection:
# nothing to fuse)
_GROUPS = (
    ("fused_qkv", _attention_inputs, fold_factors, True),
    ("fused_gate_up", _mlp_inputs, mlp_fold_factors, True),
    ("fused_o", _output_projection, fold_factors, False),
    ("fused_down", _down_projection, fold_factors, False),
)


@dataclass(eq=False)
class StackGroup:
    """A layer's q/k/v, gate/up, o or down, stacked for one generation as a copy: one GEMM instead of one per member.

    Its base weights (and biases) are copied before every generation into a buffer (`regions`, `load_stacks`), with
    room after them for copies of the adapters' A weights where those products fold into the same GEMM
    (`lora_decode.FOLD_LORA_A`: q/k/v, o and down; gate/up where `lora_a_product`'s kernel computes them from those
    rows for `fused_mlp`'s kernel; `extra_rows` 0 otherwise). The buffers are the caller's to hold only while it
    generates (the engine's `arena.GenerationArena`), and the Parameters are never touched. Why copies: re-pointing
    the members' Parameters into one persistent allocation (commits a0512db to b602886, 2026-11-26/27) freed their old
    storage in the middle of the weights' allocator segments, holes only small tensors fit, so training's large
    activations needed more memory than `compiled_generation`'s (out of memory under its reserved memory at the GSM8K
    recipe's reset-3, commit 115e9bb); and A rows kept after the base weights stayed allocated beside training (+6.5 / +60 MiB at reset-3 /
    reset-4, commit cb9bd0d). A copy costs memory only while generating."""

    group: str  # the `DecoderParts` field: "fused_qkv", "fused_gate_up", "fused_o" or "fused_down"
    index: int  # the layer
    bases: tuple[torch.nn.Linear, ...]
    adapted: list[LoraFactors]  # `fold_factors`: the live A weights whose copies ride as extra rows (none: no fold)
    extra_rows: int  # `fold_rows`; 0 without a fold
    # per member, its frozen parts whose B weights a float32 buffer joins for the decode step (`lora_decode.
    # frozen_joins`; empty: none); empty tuple: none for any member
    joins: tuple[tuple[LoraFactors, ...], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.group}.{self.index}"

    def regions(self) -> list[Region]:
        """The buffers the group is stacked in: `name` (base rows + extra rows, in_features) and, where the layers have
        biases, `name + ".bias"`."""
        weight = self.bases[0].weight
        rows = sum(base.weight.shape[0] for base in self.bases)
        buffer = f"stacks {weight.dtype}"  # one allocation for every group's stack (of one dtype)
        regions = [Region(self.name, (rows + self.extra_rows, weight.shape[1]), weight.dtype, buffer)]
        if self.bases[0].bias is not None:
            regions.append(Region(self.name + ".bias", (rows,), self.bases[0].bias.dtype, buffer))
        for index, parts in enumerate(self.joins):
            if parts:
                shape = (self.bases[index].weight.shape[0], sum(factor.up.shape[1] for factor in parts))
                regions.append(Region(self._joined(index), shape, torch.float32, f"stacks {torch.float32}"))
        return regions

    def _joined(self, index: int) -> str:
        return f"{self.name}.joined.{index}"

    def joined_buffers(self, buffers: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """Per member, its `joins` buffer among `buffers` (None: no join); empty without any."""
        if not any(self.joins):
            return ()
        return tuple(buffers[self._joined(index)] if parts else None for index, parts in enumerate(self.joins))


def plan_fusions(parts: DecoderParts) -> list[StackGroup]:
    """The groups to stack for the next generation: each layer's q/k/v and gate/up (`copyable` ones), and o and down
    where their adapters' A products fold (`lora_decode.fold_factors`). Their `parts` entries are None until
    `load_stacks` sets them (None for good: separate GEMMs). Run before every generation (the adapters may have
    changed: a hard reset)."""
    stacks = []
    for name, inputs, folded_factors, always in _GROUPS:
        entries: list[FusedLinear | None] = []
        for index, layer in enumerate(parts.layers if fused_weights.FUSE_BASE else ()):  # off: separate GEMMs
            modules = tuple(module for module in inputs(layer) if module is not None)
            bases = tuple(base_linear(module) for module in modules)
            entries.append(None)
            if not copyable(bases):
                continue
            adapted = folded_factors(modules)
            if adapted:
                joins = frozen_joins(modules, adapted, [base.weight.shape[0] for base in bases], bases[0].weight)
                rows = fold_rows(adapted, bases[0].weight.dtype)
                stacks.append(StackGroup(name, index, bases, adapted, rows, joins if any(joins) else ()))
            elif always and len(bases) > 1:
                stacks.append(StackGroup(name, index, bases, [], 0))
        setattr(parts, name, entries)
    return stacks


def load_stacks(parts: DecoderParts, stacks: list[StackGroup], buffers: Mapping[str, torch.Tensor]) -> None:
    """Stack every group of `stacks` in `buffers` (`StackGroup.regions`' names): its base weights and biases and the A
    rows (`lora_decode.refresh_folded`) copied from the live parameters, and set it in `parts`. A group stacked in the
    same buffers before keeps its `FusedLinear` (the compiled step sees the same objects)."""
    for stack in stacks:
        stacked, bias = buffers[stack.name], buffers.get(stack.name + ".bias")
        joined = stack.joined_buffers(buffers)
        fused = parts.stacks.get(stack.name)
        if (
            fused is None or fused.members != stack.bases or fused.stacked is not stacked or fused.bias is not bias
            or len(fused.joined_ups) != len(joined) or any(a is not b for a, b in zip(fused.joined_ups, joined))
        ):  # fmt: skip
            fused = dataclasses.replace(stack_copies(stack.bases, stacked, bias), joined_ups=joined)
            parts.stacks[stack.name] = fused
        copy_members(fused)
        if stack.adapted:
            refresh_folded(fused, stack.adapted)
        if joined:
            refresh_joined(fused, stack.joins)
        getattr(parts, stack.group)[stack.index] = fused


def unload_stacks(parts: DecoderParts, stacks: list[StackGroup]) -> None:
    """Take `stacks` out of `parts` (their entries None) before their buffers are freed: a view of freed memory reads
    whatever lives there next, so nothing may reach one between generations (`load_stacks` sets them again)."""
    for stack in stacks:
        getattr(parts, stack.group)[stack.index] = None


def refresh_fusions(parts: DecoderParts) -> list[StackGroup]:
    """`plan_fusions`, then `load_stacks` into buffers of their own, for callers that hold no generation arena (the
    engine uses its arena; the tests call this); returns the groups."""
    stacks = plan_fusions(parts)
    buffers = {
        region.name: torch.empty(region.shape, dtype=region.dtype, device=stack.bases[0].weight.device)
        for stack in stacks
        for region in stack.regions()
    }
    load_stacks(parts, stacks, buffers)
    return stacks


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (5.17 has the old name)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def prefill(parts: DecoderParts, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The model's forward on the left-padded prompts; returns (last-position logits (batch, vocab), [(k, v)] per layer).

    Position ids as `generate` builds them from the attention mask (`cumsum - 1`, padding at 0), so every row starts
    at position 0 whatever its padding.
    """
    from transformers import DynamicCache

    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=parts.model.config)
    outputs = parts.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_keyword(parts.model): cache},
    )
    return outputs.logits[:, -1], [(layer.keys, layer.values) for layer in cache.layers]


def decode_logits(
    parts: DecoderParts,
    tokens: torch.Tensor,
    start: torch.Tensor,
    write_index: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    float32: bool = True,
) -> torch.Tensor:
    """Logits `(batch, vocab)` for one new token per row, writing its keys/values at column `write_index`; float32 as
    `generate` hands them to its processors, or (`float32=False`) in the LM head's dtype.

    `tokens` are the previous step's tokens, `start[b]` the first live cache column of row b (its left padding), so
    its position is `write_index - start[b]`, as in `generate` (positions count only real tokens).
    """
    batch = tokens.shape[0]
    hidden = torch.nn.functional.embedding(tokens[:, None], parts.embed_tokens.weight)
    positions = (write_index - start)[:, None]
    cos, sin = parts.rotary_emb(hidden, positions)
    unfused = [None] * len(parts.layers)
    fused_qkv, fused_gate_up = parts.fused_qkv or unfused, parts.fused_gate_up or unfused
    fused_o, fused_down = parts.fused_o or unfused, parts.fused_down or unfused
    for index, (layer, key_cache, value_cache) in enumerate(zip(parts.layers, key_caches, value_caches, strict=True)):
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        query, key, value = [
            projected.view(batch, 1, -1, parts.head_dim)
            for projected in project(normed, _attention_inputs(layer), fused_qkv[index])
        ]
        if parts.qk_norm:
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key = parts.apply_rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        key_cache.index_copy_(2, write_index, key.to(key_cache.dtype))
        value_cache.index_copy_(2, write_index, value.transpose(1, 2).to(value_cache.dtype))
        attended = gqa_decode_attention(query, key_cache, value_cache, start, write_index, attention.scaling)
        hidden = hidden + project(attended.reshape(batch, 1, -1), (attention.o_proj,), fused_o[index])[0]
        normed = layer.post_attention_layernorm(hidden)
        hidden = hidden + gated_mlp(layer.mlp, normed, fused_gate_up[index], fused_down[index])
    logits = parts.lm_head(parts.norm(hidden))[:, 0]
    return logits.float() if float32 else logits
