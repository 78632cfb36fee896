"""Exact hard resets: each phase's LoRA delta kept as frozen low-rank factors beside the base weights.

Why not merge: a hard reset that adds `scale * B @ A` into a bf16 base rounds every element to 8 bits of mantissa.
At the recipes' learning rates most of a phase's delta is under half a bf16 step of its weight, so the merge drops
most of it and adds rounding noise of the same size (measured: 23 % of the phase's effect on the logits kept at lr
2e-6, ../shared/notes/low-precision-resets.md); into a 4-bit base it would re-quantise the weights at every reset.

How: the delta never touches the base. A `FrozenDelta` child of each adapted *base* layer (the `nn.Linear`, or the
bitsandbytes layer PEFT wraps) holds one part per reset, the adapter's factors as they were (`down` r x in, `up`
out x r and `scaling`, in the adapter's dtype), and a forward hook on that base layer adds each part's
`up @ (down @ x) * scaling` to its output in reset order, computed as PEFT computed the adapter. Nothing is rounded
away, and a quantised base stays exactly as loaded.

Why on the base layer: everything PEFT and TRL do with "the base" then includes the frozen deltas. PEFT's
adapter-disabled forward is TRL's reference with beta > 0, so the reference is the policy as of the last reset (as a
merged reset made it); PEFT's LoRA layer adds the fresh adapter on top.

One rounding, and a reset that changes no bit: inside a PEFT LoRA `Linear` over a plain `nn.Linear` (`deferred`),
the hook returns its float32 sum and a second hook on the LoRA layer casts the layer's output to the input's dtype
once, after PEFT has added the live adapter in float32 (`round_lora_output`). The layer computes
round(((W x + part_1) + ... + part_k) + adapter(x)) with the same operations PEFT runs for an adapter, so freezing the
adapter as part k+1 and starting a fresh one (B = 0 adds exact zeros) leaves every output bit as it was, and the
reference equals the policy. Elsewhere the hook mirrors PEFT too: under autocast (a bf16 mixed-precision launch)
the parts run under autocast and the sum is rounded at once, as PEFT's adapter runs and adds there; PEFT's
bitsandbytes LoRA layers cast each adapter's output before adding it, and so do the parts on their base layers; a
base layer no LoRA layer wraps rounds its own sum. Each reset is then bitwise a no-op on the training forward.

Cost: each part is one more pair of small float32 products per adapted layer, as the live adapter is; when a layer's
parts reach min(in, out) in total rank they are refactored exactly into one (float64 SVD), so long runs stop growing.
The rollout engine folds the parts' A weights into its stacked GEMMs (`prorl_trl.rollout.lora_decode`). On a small,
launch-bound model the per-part products dominate: each reset made every later step ~0.09 s slower (+23 %) on an
H100 (benchmarks/results/prolonged_runs/round3.md). `consolidate=True` (`ProRLConfig.consolidate_frozen_parts`)
therefore joins a layer's float32 parts into one at each reset (`FrozenDelta.consolidate`: the ranks stacked, each
part's scaling folded into its `up` in float32), so the forward pays for one part however many resets came before. The delta is kept to
float32 rounding, but the joined product sums in another order than the parts did, so such a reset is no longer
bitwise a no-op: it moves outputs by float32 rounding (a value rounded to bf16 flips one step where the float32 sum
sat on a rounding boundary, and later layers carry the flip on: bf16 logits move by under one bf16 step of the
largest logit, tests/test_frozen_consolidation.py).

Room for later resets (`consolidate(room=...)`): a joined part whose rank grows at every reset gives the rollout
engine new weight shapes at every reset, so it recompiles its decode step for training and for validation (~30 s
each on an H100: the study's ProRL runs spent ~60 s per reset there). A joined part may therefore carry zero rank
beyond what it holds (`used`: the rank holding factors; the rows of `down` and columns of `up` past it are zeros,
which add exactly nothing); a later reset writes its part into that room in place, so shapes and storage stay
what the engine captured and it replays its graphs. The trainer leaves room for the resets its phases plan.

The factors are buffers of a module that keeps their dtype whatever the model is cast to (`FrozenDelta._apply`:
DeepSpeed's bf16 engine calls `module.bfloat16()` at every phase) and out of the state dict (non-persistent): a run
saves them itself (`frozen_state_dict`, `load_frozen_`) and merged saves fold them in (`save`, `gathered`).
`freeze_lora_delta` reads the adapter through `engine.py`'s primitives, so the same call serves one process, DDP,
FSDP2 and ZeRO-2/3 (collective there); the buffers are replicated on every rank.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .engine import FSDP2, full_value, gathered, reshard
from .support import (
    ADAPTER_NAME,
    base_model_of,
    canonical_name,
    check_lora_supported,
    is_bnb_lora_layer,
    lora_layers,
    peft_model_of,
    unwrap_model,
)

FROZEN_MODULE = "prorl_frozen"  # the child of a base layer that holds its frozen factors
# Which forwards a layer's frozen parts act in (`FrozenDelta.acts_in`). A full hard reset's parts act in both: the
# policy and TRL's LoRA reference (the adapter-disabled model) move together. One part of the reset alone needs
# parts that act in one: a fresh adapter with the reference kept (the old adapter frozen for the policy only), or a
# reference reset with the adapter kept (a copy of the live delta for the reference only).
BOTH, POLICY, REFERENCE = "both", "policy", "reference"
ACTS_IN = (BOTH, POLICY, REFERENCE)  # saved as this index (`frozen_state_dict`)


class FrozenDelta(nn.Module):
    """Frozen LoRA factors of one base layer, one part per hard reset: part i adds `up_i @ (down_i @ x) * scaling_i`.

    `down_i` is (rank_i, in_features), `up_i` (out_features, rank_i), copies of the adapter's weights in its own dtype
    (float32 as PEFT keeps adapters; bf16 where TRL casts a QLoRA adapter), so each part computes what the adapter
    computed. `bias` (out_features,) holds the parts' LoRA biases, already scaled, or is None. Buffers, not
    Parameters: no optimizer, DDP reducer, FSDP shard or ZeRO partition ever sees them, and they never train.
    """

    def __init__(self, acts_in: str = BOTH):
        super().__init__()
        if acts_in not in ACTS_IN:
            raise ValueError(f"FrozenDelta: acts_in must be one of {ACTS_IN}, got {acts_in!r}.")
        self.acts_in = acts_in  # the forwards the parts act in: every one, the policy's, or the reference's
        self.scalings: list[float] = []
        self.used: list[int] = []  # per part, the rank holding factors (the rest is zero room for later resets)
        self.register_buffer("bias", None, persistent=False)
        self.deferred = False  # the LoRA layer around the base layer rounds the sum (`round_lora_output`)
        self.round_each = False  # each part's output is cast to the base output's dtype first (PEFT's bnb layers)
        self._lora_layer = None  # weakref to the PEFT LoRA layer around the base layer (`compute_dtype`)

    def append(self, down: torch.Tensor, up: torch.Tensor, scaling: float, used: int | None = None) -> None:
        """One more part (copied; floating dtypes are kept, anything else becomes float32). `used`: its first `used`
        ranks hold factors and the rest are zeros (default: all)."""
        index = len(self.scalings)
        self.register_buffer(f"down_{index}", _copy(down), persistent=False)
        self.register_buffer(f"up_{index}", _copy(up), persistent=False)
        self.scalings.append(float(scaling))
        self.used.append(down.shape[0] if used is None else int(used))

    @property
    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """`(down, up, scaling)` per part, in reset order."""
        return [(getattr(self, f"down_{i}"), getattr(self, f"up_{i}"), s) for i, s in enumerate(self.scalings)]

    @property
    def rank(self) -> int:
        """The rank holding factors (room left for later resets not counted)."""
        return sum(self.used)

    def compute_dtype(self, down: torch.Tensor) -> torch.dtype:
        """The dtype the live adapter computes in right now (its A weight's, as the forward sees it: FSDP2's mixed
        precision hands the forward bf16 copies of float32 weights), else the part's own."""
        lora_layer = self._lora_layer() if self._lora_layer is not None else None
        lora_a = getattr(lora_layer, "lora_A", {})
        return lora_a["default"].weight.dtype if "default" in lora_a else down.dtype

    def acts_now(self) -> bool:
        """Whether the parts act in the forward running now. The policy's forward is the LoRA layer's with its
        "default" adapter active; TRL's reference disables the adapters (or activates its "ref" adapter)."""
        if self.acts_in == BOTH:
            return True
        lora_layer = self._lora_layer() if self._lora_layer is not None else None
        policy = lora_layer is not None and is_policy_forward(lora_layer)
        return policy if self.acts_in == POLICY else not policy

    def add_to(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`output` plus every part's product, one after the other, each computed as PEFT computes the live adapter's
        output in this context (`lora_B(lora_A(x)) * scaling` on the input cast to the adapter's dtype, under autocast
        where autocast is on; cast to the output's dtype first for a bitsandbytes layer outside autocast) and added
        as PEFT adds it (promoted: a bf16 output plus float32 parts is a float32 sum). Parts that do not act in this
        forward (`acts_now`) add nothing."""
        if not self.acts_now():
            return output
        autocast = torch.is_autocast_enabled(x.device.type)
        inputs: dict[torch.dtype, torch.Tensor] = {}  # the input cast once per dtype, not once per part
        for down, up, scaling in self.parts:
            dtype = self.compute_dtype(down)
            cast = inputs.setdefault(dtype, x.to(dtype))
            part = nn.functional.linear(nn.functional.linear(cast, down.to(dtype)), up.to(dtype)) * scaling
            output = output + (part.to(output.dtype) if self.round_each and not autocast else part)
        return output if self.bias is None else output + self.bias

    def consolidate(self, room: int = 0) -> bool:
        """Join the parts into one of their total rank: downs stacked, ups side by side, each up times its scaling (in
        float32, exact to rounding), scaling 1. Only float32 parts (a bf16 QLoRA adapter's would round the scaled up
        to bf16); returns whether it joined anything.

        `room`: zero rank to leave past the joined one, for later resets (capped at min(out, in)). Where the first
        part is a joined one with room enough for the others, they are written into it in place (same tensors, same
        shapes: the rollout engine keeps its graphs); the values are those a join without room gives."""
        parts = self.parts
        if any(t.dtype != torch.float32 for down, up, _ in parts for t in (down, up)):
            return False
        if len(parts) < 2 and (room <= 0 or not parts):
            return False
        (first_down, first_up, first_scaling), rest = parts[0], list(zip(parts[1:], self.used[1:], strict=True))
        start = self.used[0]
        if rest and first_scaling == 1.0 and start + sum(used for _, used in rest) <= first_down.shape[0]:
            for (down, up, scaling), used in rest:
                first_down[start : start + used].copy_(down[:used])
                first_up[:, start : start + used].copy_(up[:, :used] * scaling)
                start += used
            for index in range(1, len(self.scalings)):
                delattr(self, f"down_{index}")
                delattr(self, f"up_{index}")
            self.scalings, self.used = self.scalings[:1], [start]
            return True
        used_parts = [(down[:used], up[:, :used], scaling) for (down, up, scaling), used in zip(parts, self.used)]
        down = torch.cat([down for down, _, _ in used_parts], dim=0)
        up = torch.cat([up * scaling for _, up, scaling in used_parts], dim=1)
        rank = down.shape[0]
        room = max(0, min(room, min(up.shape[0], down.shape[1]) - rank))
        if room:
            down = torch.cat([down, down.new_zeros(room, down.shape[1])], dim=0)
            up = torch.cat([up, up.new_zeros(up.shape[0], room)], dim=1)
        self._replace_parts(down, up, used=rank)
        return True

    def weight_delta(self) -> torch.Tensor:
        """The dense delta, the parts' `up @ down * scaling` summed in float32 (out_features, in_features)."""
        return sum((up.float() @ down.float()) * scaling for down, up, scaling in self.parts)

    def refactor(self) -> None:
        """Replace the parts by one of rank min(out, in) with the same product (float64 SVD, then float32)."""
        dense = sum((up.double() @ down.double()) * scaling for down, up, scaling in self.parts)
        left, values, right = torch.linalg.svd(dense, full_matrices=False)
        self._replace_parts(right.float(), (left * values).float())

    def _replace_parts(self, down: torch.Tensor, up: torch.Tensor, used: int | None = None) -> None:
        """Every part replaced by the one part `(down, up)` with scaling 1."""
        for index in range(len(self.scalings)):
            delattr(self, f"down_{index}")
            delattr(self, f"up_{index}")
        self.scalings, self.used = [], []
        self.append(down, up, 1.0, used)

    def _apply(self, fn, recurse=True):
        """Move with the model (`.to(device)`, `.cuda()`) but keep each factor's dtype: a model-wide cast
        (`.bfloat16()`, which DeepSpeed's bf16 engine applies) would round float32 factors, which is what this module
        exists to avoid."""
        for name, tensor in list(self._buffers.items()):
            if tensor is not None:
                self._buffers[name] = tensor.to(device=fn(tensor[:0]).device)
        return self


def is_policy_forward(lora_layer: nn.Module) -> bool:
    """Whether a PEFT LoRA layer runs as the policy: adapters enabled and the "default" adapter active."""
    return not lora_layer.disable_adapters and ADAPTER_NAME in lora_layer.active_adapters


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(tensor.dtype if tensor.is_floating_point() else torch.float32).clone().contiguous()


def add_frozen_delta(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a base layer: its output plus its frozen parts; left in the sum's dtype where the LoRA layer
    around it rounds once after adding its adapter (`deferred`), else cast to the output's dtype."""
    frozen = getattr(module, FROZEN_MODULE, None)
    if frozen is None:
        return output
    total = frozen.add_to(output, args[0])
    if frozen.deferred and output.dtype == args[0].dtype and not torch.is_autocast_enabled(output.device.type):
        return total
    return total.to(output.dtype)


def round_lora_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a LoRA layer whose base layer defers its rounding (`add_frozen_delta`): the output cast once to
    the input's dtype (a plain `nn.Linear` maps a dtype to itself), after PEFT added the adapter in float32."""
    if torch.is_autocast_enabled(output.device.type):
        return output
    return output.to(args[0].dtype)


def frozen_delta_of(base_layer: nn.Module) -> FrozenDelta | None:
    """The base layer's `FrozenDelta`, or None when no reset has frozen a delta on it."""
    frozen = getattr(base_layer, FROZEN_MODULE, None)
    return frozen if isinstance(frozen, FrozenDelta) else None


def frozen_layers(model: nn.Module) -> list[tuple[str, nn.Module, FrozenDelta]]:
    """`(name, base layer, its FrozenDelta)` for every base layer with frozen factors, in module order; names as
    `from_pretrained` spells the layer (`support.canonical_name`: no PEFT prefix, no `.base_layer`), so they stay the
    same when a LoRA shape change wraps other modules."""
    return [
        (canonical_name(name), module, frozen)
        for name, module in base_model_of(model).named_modules()
        if (frozen := frozen_delta_of(module)) is not None
    ]


def base_layers(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module | None]]:
    """Canonical name -> (the module that computes that layer's base output, the PEFT LoRA layer wrapping it or None),
    for every layer with a weight: where frozen factors can be attached."""
    from peft.tuners.lora import LoraLayer

    layers: dict[str, tuple[nn.Module, nn.Module | None]] = {}
    wrappers = {}
    for name, module in base_model_of(model).named_modules():
        if isinstance(module, LoraLayer):
            wrappers[canonical_name(name)] = module
        elif not (isinstance(module, FrozenDelta) or "lora_" in name or not hasattr(module, "weight")):
            layers[canonical_name(name)] = module
    return {name: (base, wrappers.get(name)) for name, base in layers.items()}


@torch.no_grad()
def attach_frozen_delta(
    base_layer: nn.Module,
    down: torch.Tensor,
    up: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    lora_layer: nn.Module | None = None,
    consolidate: bool = False,
    room_for: int = 0,
    used: int | None = None,
    acts_in: str = BOTH,
) -> FrozenDelta:
    """Append a part (`down` r x in, `up` out x r, `scaling`; `bias`, unscaled, for a LoRA bias) to the base layer's
    frozen delta, creating it (and its hook) on first use; copied in their dtype onto the base layer's device.
    `lora_layer`: the PEFT LoRA layer that wraps `base_layer`: its output is then rounded once where the base layer is
    a plain `nn.Linear`, and each part's output is cast first where it is a bitsandbytes layer (as PEFT computes
    those). `consolidate`: join the float32 parts into one (`FrozenDelta.consolidate`), with zero room for `room_for`
    more parts of this one's rank. `used`: the rank of this part that holds factors (a saved part with room). Parts
    beyond min(in, out) in total rank are refactored into one (`refactor`). `acts_in`: the forwards the part acts in
    (`BOTH`, `POLICY`, `REFERENCE`); one layer's parts all act in the same ones, and the one-forward kinds need the
    LoRA layer that tells the forwards apart."""
    if acts_in not in ACTS_IN:
        raise ValueError(f"attach_frozen_delta: acts_in must be one of {ACTS_IN}, got {acts_in!r}.")
    if acts_in != BOTH and lora_layer is None:
        raise ValueError(
            f"A frozen LoRA part that acts in the {acts_in}'s forward only needs the LoRA layer around its base layer "
            "(PEFT's disabled adapters tell the reference's forward from the policy's); this layer has none."
        )
    device = _device_of(base_layer)
    frozen = frozen_delta_of(base_layer)
    if frozen is not None and frozen.acts_in != acts_in and frozen.scalings:
        raise ValueError(
            f"This layer's frozen LoRA parts act in {frozen.acts_in} forward(s), and a part acting in {acts_in} "
            "cannot join them: a run keeps one kind of reset (reset_adapter / reset_reference) from start to end."
        )
    if frozen is None:
        frozen = FrozenDelta(acts_in)
        base_layer.add_module(FROZEN_MODULE, frozen)
    frozen.acts_in = acts_in
    frozen.append(down.to(device), up.to(device), scaling, used)
    if bias is not None:
        bias = bias.to(device=device, dtype=torch.float32) * scaling
        frozen.bias = bias if frozen.bias is None else frozen.bias + bias
    out_features, in_features = frozen.parts[0][1].shape[0], frozen.parts[0][0].shape[1]
    if len(frozen.scalings) > 1 and frozen.rank > min(out_features, in_features):
        frozen.refactor()
    elif consolidate:
        frozen.consolidate(room=room_for * frozen.used[-1])
    if add_frozen_delta not in base_layer._forward_hooks.values():
        base_layer.register_forward_hook(add_frozen_delta)
    if lora_layer is not None and type(base_layer) is nn.Linear:
        if round_lora_output not in lora_layer._forward_hooks.values():
            lora_layer.register_forward_hook(round_lora_output)
        frozen.deferred = True
    frozen.round_each = lora_layer is not None and is_bnb_lora_layer(lora_layer)
    frozen._lora_layer = None if lora_layer is None else weakref.ref(lora_layer)
    return frozen


def _device_of(module: nn.Module) -> torch.device:
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = next(module.parameters())
    return weight.device


@dataclass
class FreezeReport:
    """What a freeze did: `layers` adapted layers whose delta was frozen, `rank_added` (sum over layers of the ranks
    appended) and `frozen_rank` (the largest concatenated rank of any layer, which the forward pays for)."""

    layers: int = 0
    rank_added: int = 0
    frozen_rank: int = 0

    def describe(self) -> str:
        return (
            f"the LoRA delta of {self.layers} layers was kept exactly as frozen factors (rank {self.frozen_rank} "
            "per layer at most), the base weights untouched"
        )


def _live_factors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The "default" adapter's whole A, B and (LoRA bias) B bias of one layer; call inside `gathered` (ZeRO-3)."""
    lora_b = layer.lora_B[ADAPTER_NAME]
    with_bias = bool(layer.lora_bias.get(ADAPTER_NAME)) and lora_b.bias is not None
    down = full_value(layer.lora_A[ADAPTER_NAME].weight)
    up = full_value(lora_b.weight)
    return down, up, (full_value(lora_b.bias) if with_bias else None)


@torch.no_grad()
def freeze_lora_delta(
    model: nn.Module,
    engine: str | None = None,
    active_layers: frozenset[str] | None = None,
    consolidate: bool = False,
    room_for: int = 0,
    acts_in: str = BOTH,
) -> FreezeReport:
    """Move the "default" adapter's delta into each layer's frozen factors; the base weights are not written.

    The function is unchanged only once B is zeroed (`lora.reinit_adapter` / `sharded.fresh_adapter_sharded`): call
    them back to back, as a merge and a re-init are. `active_layers` (names in the base model): the layers whose
    adapter is live this phase (a superset adapter's idle layers hold zeros); None: all. Columns of B that are all zero
    (a superset adapter's idle rank) are left out. Under every engine the factors are read whole (FSDP2: gathered from
    the shards; ZeRO-3: inside a read-only gather), so the call is collective there and every rank attaches the same
    factors. A layer PEFT holds merged (`merge_adapter` without `unmerge_adapter`) is unmerged first. `consolidate`:
    each layer's float32 parts are joined into one (see the module docstring: one part's cost, float32 rounding),
    with zero room for `room_for` later resets of the same rank, written in place then (the rollout engine's graphs
    stay valid). `acts_in=POLICY`: the delta stays in the policy only, so TRL's LoRA reference (the adapter-disabled
    model) does not move (`reset_reference=False`).
    """
    check_lora_supported(model)
    if engine == FSDP2:
        reshard(model)
    report = FreezeReport()
    for name, layer in lora_layers(peft_model_of(model).get_base_model()):
        if active_layers is not None and name not in active_layers:
            continue
        if ADAPTER_NAME in layer.merged_adapters:
            layer.unmerge()
        lora_b = layer.lora_B[ADAPTER_NAME]
        tensors = [t for t in (layer.lora_A[ADAPTER_NAME].weight, lora_b.weight, lora_b.bias) if t is not None]
        with gathered(tensors):
            down, up, bias = _live_factors(layer)
            keep = up.abs().sum(0) > 0  # zero columns of B add nothing (a fresh or idle superset rank)
            if not bool(keep.any()) and (bias is None or not bool(bias.any())):
                continue
            frozen = attach_frozen_delta(
                layer.get_base_layer(), down[keep], up[:, keep], layer.scaling[ADAPTER_NAME], bias, lora_layer=layer,
                consolidate=consolidate, room_for=room_for, acts_in=acts_in,
            )  # fmt: skip
        report.layers += 1
        report.rank_added += int(keep.sum())
        report.frozen_rank = max(report.frozen_rank, frozen.rank)
    return report


def snapshot_reference_delta(model: nn.Module) -> FreezeReport:
    """A reference reset that keeps the adapter: TRL's LoRA reference (the adapter-disabled model) becomes the policy
    as it is now, while the policy's own forward is unchanged. The last reset's reference-only parts are dropped and
    the live "default" delta is frozen again as the reference's alone (`acts_in=REFERENCE`), added as PEFT adds the
    adapter, so the reference's outputs equal the policy's bit for bit."""
    for _, base, frozen in frozen_layers(model):
        if frozen.acts_in != REFERENCE:
            raise ValueError(
                f"This layer's frozen LoRA parts act in {frozen.acts_in} forward(s): a reference-only reset cannot "
                "join them (a run keeps one kind of reset, reset_adapter / reset_reference, from start to end)."
            )
        delattr(base, FROZEN_MODULE)
    return freeze_lora_delta(model, acts_in=REFERENCE)


def keep_out_of_ddp_broadcasts(model: nn.Module) -> list[str]:
    """Keep the frozen factors out of DDP's buffer broadcast (`broadcast_buffers`: rank 0's buffers sent to every rank
    before each forward): they are identical on every rank by construction, and grow with every reset. Names them in
    `_ddp_params_and_buffers_to_ignore` of the module DDP wraps (what a wrapper built later reads) and, when `model`
    is a live `DistributedDataParallel`, in its `parameters_to_ignore` (DDP re-reads the module's buffers before every
    broadcast, so factors added after it was built would be sent too). Returns the names."""
    unwrapped = unwrap_model(model)
    names = [name for name, _ in unwrapped.named_buffers() if f".{FROZEN_MODULE}." in f".{name}"]
    kept = [name for name in getattr(unwrapped, "_ddp_params_and_buffers_to_ignore", []) if FROZEN_MODULE not in name]
    unwrapped._ddp_params_and_buffers_to_ignore = kept + names
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.parameters_to_ignore.update(names)
    return names


# ------------------------------------------------------------------------------------------- saving and loading
def frozen_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every frozen factor on the CPU, keyed `<layer>.prorl_frozen.<part>.<down|up|scaling>` (and
    `<layer>.prorl_frozen.bias`) with the layer's `from_pretrained` name: what `load_frozen_` reads back (and
    `<layer>.prorl_frozen.acts_in`, an index into `ACTS_IN`, where the parts act in one forward only). `scaling` is
    a one-element float64 tensor, so safetensors can hold it. A part with room for later resets is saved with its
    room (a resumed run computes with the same shapes) and its used rank as `<part>.rank`."""
    state = {}
    for name, _, frozen in frozen_layers(model):
        prefix = f"{name}.{FROZEN_MODULE}."
        for index, ((down, up, scaling), used) in enumerate(zip(frozen.parts, frozen.used, strict=True)):
            state[f"{prefix}{index}.down"] = down.detach().cpu().contiguous()
            state[f"{prefix}{index}.up"] = up.detach().cpu().contiguous()
            state[f"{prefix}{index}.scaling"] = torch.tensor([scaling], dtype=torch.float64)
            if used != down.shape[0]:
                state[f"{prefix}{index}.rank"] = torch.tensor([used], dtype=torch.int64)
        if frozen.bias is not None:
            state[prefix + "bias"] = frozen.bias.detach().cpu().contiguous()
        if frozen.acts_in != BOTH:
            state[prefix + "acts_in"] = torch.tensor([ACTS_IN.index(frozen.acts_in)], dtype=torch.int64)
    return state


@torch.no_grad()
def load_frozen_(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Replace the model's frozen factors with `state` (`frozen_state_dict`'s); returns the number of layers.

    Every layer named must exist and match the factors' shapes: a resume onto another model refuses rather than
    attaching part of a run. Layers not named lose their frozen factors (the state is the whole set). Every rank
    loads the same file, so the factors stay replicated.
    """
    layers = base_layers(model)
    names = sorted({key.rsplit(f".{FROZEN_MODULE}.", 1)[0] for key in state})
    unknown = [name for name in names if name not in layers]
    if unknown:
        raise ValueError(
            f"The saved frozen LoRA factors name {unknown[:3]}, which are not layers of this model: they were saved "
            "from another model."
        )
    for _, base, _ in frozen_layers(model):
        delattr(base, FROZEN_MODULE)
    for name in names:
        prefix = f"{name}.{FROZEN_MODULE}."
        base, wrapper = layers[name]
        out_features, in_features = _base_shape(base)
        code = state.get(prefix + "acts_in")
        code = 0 if code is None else int(code.item())
        if not 0 <= code < len(ACTS_IN):
            raise ValueError(f"The saved frozen LoRA factors of {name!r} say acts_in {code}, not 0-{len(ACTS_IN) - 1}.")
        index = 0
        while f"{prefix}{index}.down" in state:
            down, up = state[f"{prefix}{index}.down"], state[f"{prefix}{index}.up"]
            if down.shape[1] != in_features or up.shape[0] != out_features or up.shape[1] != down.shape[0]:
                raise ValueError(
                    f"The saved frozen LoRA factors of {name!r} are {tuple(up.shape)} x {tuple(down.shape)}, which "
                    f"does not fit its ({out_features}, {in_features}) weight: they were saved from another model."
                )
            scaling = float(state[f"{prefix}{index}.scaling"].item())
            used = state.get(f"{prefix}{index}.rank")
            used = None if used is None else int(used.item())
            if used is not None and not 0 <= used <= down.shape[0]:
                raise ValueError(f"The saved frozen LoRA part {index} of {name!r} says rank {used} of {down.shape[0]}.")
            frozen = attach_frozen_delta(
                base, down, up, scaling, lora_layer=wrapper, used=used, acts_in=ACTS_IN[code]
            )
            index += 1
        if prefix + "bias" in state:
            frozen.bias = state[prefix + "bias"].to(device=_device_of(base), dtype=torch.float32)
    return len(names)


def _base_shape(base: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a base layer (a quantised weight's storage has another shape)."""
    out_features, in_features = getattr(base, "out_features", None), getattr(base, "in_features", None)
    if out_features is None or in_features is None:
        out_features, in_features = base.weight.shape
    return int(out_features), int(in_features)


def frozen_rank_total(model: nn.Module) -> int:
    """The sum of the frozen ranks over all layers (0: nothing frozen)."""
    return sum(frozen.rank for _, _, frozen in frozen_layers(model))
