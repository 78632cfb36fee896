"""Worker for tests/test_sharded_resets.py: the FSDP2 reset mechanics on 2 CPU processes (gloo), against one process.

Run as `torchrun --nproc_per_node 2 tests/_fsdp2_worker.py OUT.json [reference_only]` (the second argument: only
the reference-only reset, tests/test_reference_only_reset_fsdp2.py). accelerate runs FSDP only on accelerators, so
the model is sharded here the way accelerate's `fsdp2_prepare_model` does it (`fully_shard` on every decoder layer,
then on the root; the reference root-only, as TRL's `prepare_fsdp`); every rank also keeps an unsharded copy that
the same operations run on in one process. The tiny model's vocabulary (265 rows) is not divisible by 2, so one
shard is a row shorter. Rank 0 writes what it measured; the test asserts on it.

Both reset modes are covered: "merge" (`merge_lora_sharded`) and "frozen" (`freeze_lora_delta`, the default: the delta
kept as float32 factors on each base layer), on a float32 model and on a bf16 base with float32 LoRA weights, sharded
as plain `fully_shard` and as accelerate shards it under `mixed_precision: bf16` (`MixedPrecisionPolicy(param_dtype=
bfloat16)`: the live adapter is then evaluated in bf16), and on a superset adapter whose active part is frozen.
"""

import contextlib
import copy
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer  # noqa: E402

from prorl_trl.recipe.run import leave_process_group  # noqa: E402
from prorl_trl.reset import (  # noqa: E402
    FSDP2,
    freeze_lora_delta,
    fresh_adapter_sharded,
    frozen_layers,
    frozen_state_dict,
    gathered_state_dict,
    load_state_,
    lora_layers,
    merge_lora_in_place,
    merge_lora_sharded,
    merged_state_dict,
    reinit_adapter,
    reset_optimizer_state,
    reset_reference_adapter,
    snapshot_reference_delta,
    sync_reference_sharded,
    targeted_module_names,
)
from prorl_trl.reset.engine import full_value, is_dtensor, local_value, reshard, write_full_  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402


def shard_like_accelerate(model, mp_policy=None):
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for module in model.modules():
        if isinstance(module, Qwen2DecoderLayer):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def lora_model(seed_b: int, dtype=torch.float32, b_scale: float = 0.1, **config):
    """The tiny model in `dtype` with a LoRA adapter (PEFT keeps it in float32 on a bf16 base) whose B is random."""
    model, tokenizer = build_tiny(seed=0)
    model = model.to(dtype)
    with torch.random.fork_rng(devices=[]):  # the same replica on every rank before sharding (as after a broadcast)
        torch.manual_seed(0)
        peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **config))
    set_lora_b_(peft, seed_b, b_scale)  # a trained-looking adapter: B != 0
    return peft, tokenizer


@torch.no_grad()
def set_lora_b_(model, seed: int, scale: float) -> None:
    """B := scale * randn (one seeded generator, layer by layer): the same values in a sharded model and its replica."""
    reshard(model)
    generator = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(model):
        weight = layer.lora_B["default"].weight
        write_full_(weight, torch.randn(tuple(weight.shape), generator=generator) * scale)


@torch.no_grad()
def logits_of(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


@torch.no_grad()
def base_weights(model) -> dict:
    """Every non-LoRA parameter, whole (gathered from the shards)."""
    reshard(model)
    return {n: full_value(p).detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def state_digest(state: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@torch.no_grad()
def folded_by_hand(replica) -> dict:
    """The replica's adapted weights with every frozen part and the live delta added in float32, written out here
    (independently of `iter_policy_weights`) and cast to the weight's dtype: {from_pretrained name: weight}."""
    base = replica.get_base_model()
    frozen = frozen_state_dict(replica)
    out = {}
    for name, layer in lora_layers(base):
        weight = layer.get_base_layer().weight
        total = weight.float()
        index = 0
        while f"{name}.prorl_frozen.{index}.down" in frozen:
            part = f"{name}.prorl_frozen.{index}."
            total = total + (frozen[part + "up"] @ frozen[part + "down"]) * float(frozen[part + "scaling"])
            index += 1
        live = layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float()
        total = total + live * layer.scaling["default"]
        out[f"{name}.weight"] = total.to(weight.dtype)
    return out


def main(out_path: str, section: str | None = None) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(1234 + dist.get_rank())  # each rank's global RNG differs, as under TRL's device-specific seed
    torch.set_num_threads(1)
    results = {}
    probe = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    if section == "reference_only":
        reference_only_reset(results, probe)
        if dist.get_rank() == 0:
            Path(out_path).write_text(json.dumps(results, indent=1))
        leave_process_group()
        return

    # --- LoRA: merge into sharded bases, fresh adapter (same shape), gathered merged state, load --------------------
    sharded, _ = lora_model(seed_b=7, r=8, lora_alpha=16, target_modules="all-linear")
    single = copy.deepcopy(sharded)
    shard_like_accelerate(sharded)
    results["weights_are_dtensors"] = all(is_dtensor(p) for p in sharded.parameters())
    embed = dict(sharded.named_parameters())["base_model.model.model.embed_tokens.weight"]
    results["embedding_rows_per_rank"] = all_ranks(int(embed.to_local().shape[0]))
    expected = merged_state_dict(single)
    gathered = gathered_state_dict(sharded)
    results["gathered_vs_single_merged"] = max_diff(gathered, expected) if dist.get_rank() == 0 else 0.0
    with torch.no_grad():
        before = sharded(input_ids=probe).logits
    rounding = merge_lora_sharded(sharded, FSDP2)
    shape = fresh_adapter_sharded(sharded, FSDP2, seed=99)
    with torch.no_grad():
        after = sharded(input_ids=probe).logits
    results["reset_logits_max_abs_diff"] = float((after - before).abs().max())
    single_rounding = merge_lora_in_place(single)
    reinit_adapter(single, seed=99)
    results["rounding_delta_sq_per_rank"] = all_ranks(rounding.delta_sq)
    results["rounding_delta_sq_single"] = single_rounding.delta_sq
    results["rounding_lost_fraction_sharded_single"] = [rounding.lost_fraction, single_rounding.lost_fraction]
    base_after = gathered_state_dict(sharded, to_all_ranks=True)
    results["merged_base_vs_single"] = max_diff(base_after, merged_state_dict(single))
    adapters = {n: full_value(p).detach().clone() for n, p in sharded.named_parameters() if "lora_" in n}
    single_adapters = {n: p.detach() for n, p in single.named_parameters() if "lora_" in n}
    results["fresh_adapter_vs_single_bitwise"] = max_diff(adapters, single_adapters)
    results["fresh_b_all_zero"] = all(float(v.abs().max()) == 0 for n, v in adapters.items() if "lora_B" in n)
    results["adapter_hash_per_rank"] = all_ranks(float(sum(v.double().sum() for v in adapters.values())))
    results["fresh_shape"] = {"r": shape["r"], "targets": len(shape["target_names"])}
    # load_state_ writes whole tensors back into the shards
    scaled = {k: v * 0.5 for k, v in base_after.items()}
    load_state_(sharded, scaled)
    results["load_state_roundtrip"] = max_diff(gathered_state_dict(sharded, to_all_ranks=True), scaled)

    frozen_float32(results, probe)
    frozen_bf16(results, probe)

    # --- superset adapter: a rank-4 adapter on q,v as the active part of r=8 on all linear layers --------------------
    superset, _ = lora_model(seed_b=7, r=8, lora_alpha=16, target_modules="all-linear")
    shard_like_accelerate(superset)
    targets = targeted_module_names(superset, ["q_proj", "v_proj"])
    fresh_adapter_sharded(superset, FSDP2, seed=5, rank=4, lora_alpha=12, target_names=targets)
    plain, _ = lora_model(seed_b=7, r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"])
    reinit_adapter(plain, seed=5)
    active = {}
    for name, param in superset.named_parameters():
        if "lora_" in name:
            active[name] = full_value(param).detach().clone()
    plain_params = dict(plain.named_parameters())
    worst_active, worst_inactive = 0.0, 0.0
    for name, value in active.items():
        module = name.split(".lora_")[0].removeprefix("base_model.model.")
        if module in targets:
            if "lora_A" in name:
                worst_active = max(worst_active, float((value[:4] - plain_params[name].detach()).abs().max()))
                worst_inactive = max(worst_inactive, float(value[4:].abs().max()))
            else:
                worst_inactive = max(worst_inactive, float(value.abs().max()))
        else:
            worst_inactive = max(worst_inactive, float(value.abs().max()))
    results["superset_active_vs_plain_bitwise"] = worst_active
    results["superset_inactive_max_abs"] = worst_inactive
    # one AdamW step with weight decay on the same batch: inactive entries get exactly zero gradient and stay zero,
    # and the active part moves exactly as the plain rank-4 adapter does
    with torch.no_grad():  # make B nonzero in the active columns, identically in both models
        generator = torch.Generator().manual_seed(3)
        for name, layer in lora_layers(plain):
            value = torch.randn(layer.lora_B["default"].weight.shape, generator=generator) * 0.1
            layer.lora_B["default"].weight.copy_(value)
            target = dict(superset.named_modules())[name]
            full = torch.zeros(full_value(target.lora_B["default"].weight).shape)
            full[:, :4] = value
            write_full_(target.lora_B["default"].weight, full)
    batch = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 9, 60]])
    for model in (superset, plain):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        model._test_optimizer = optimizer
    worst_active, worst_inactive = 0.0, 0.0
    plain_params = dict(plain.named_parameters())
    for name, param in superset.named_parameters():
        if "lora_" not in name:
            continue
        value = full_value(param).detach()
        module = name.split(".lora_")[0].removeprefix("base_model.model.")
        if module not in targets:
            worst_inactive = max(worst_inactive, float(value.abs().max()))
        elif "lora_A" in name:
            worst_active = max(worst_active, float((value[:4] - plain_params[name].detach()).abs().max()))
            worst_inactive = max(worst_inactive, float(value[4:].abs().max()))
        else:
            worst_active = max(worst_active, float((value[:, :4] - plain_params[name].detach()).abs().max()))
            worst_inactive = max(worst_inactive, float(value[:, 4:].abs().max()))
    results["superset_after_step_active_vs_plain"] = worst_active
    results["superset_after_step_inactive_max_abs"] = worst_inactive
    state_before = len(superset._test_optimizer.state)
    reset_optimizer_state(superset._test_optimizer)
    results["optimizer_state_entries_before_after_reset"] = [state_before, len(superset._test_optimizer.state)]
    # a frozen reset of the superset adapter with a shape change (the trainer's phase boundary): only the active part
    # is frozen (the idle layers' adapters and the zero columns of B beyond rank 4 are left out), the same factors as
    # the plain rank-4 adapter's, and the next phase's adapter (rank 8 on all linear layers) starts at B = 0
    before = logits_of(superset, probe)
    report = freeze_lora_delta(superset, FSDP2, active_layers=targets)
    fresh_adapter_sharded(superset, FSDP2, seed=6, rank=8, lora_alpha=16)
    after = logits_of(superset, probe)
    plain_report = freeze_lora_delta(plain)
    layers = frozen_layers(superset)
    results["superset_frozen_layers_are_targets"] = sorted(name for name, _, _ in layers) == sorted(targets)
    results["superset_frozen_ranks"] = sorted({frozen.rank for _, _, frozen in layers})
    results["superset_frozen_reports"] = [[r.layers, r.rank_added, r.frozen_rank] for r in (report, plain_report)]
    results["superset_frozen_vs_plain"] = max_diff(frozen_state_dict(superset), frozen_state_dict(plain))
    results["superset_frozen_reset_logits_max_abs_diff"] = float((after - before).abs().max())
    results["superset_frozen_hash_per_rank"] = all_ranks(state_digest(frozen_state_dict(superset)))
    results["superset_all_linear_b_zero"] = all(
        float(full_value(layer.lora_B["default"].weight).abs().max()) == 0 for _, layer in lora_layers(superset)
    )

    # --- full fine-tuning: reference := policy, the reference sharded root-only as TRL's prepare_fsdp ---------------
    policy, _ = build_tiny(seed=0)
    reference, _ = build_tiny(seed=1)
    shard_like_accelerate(policy)
    fully_shard(reference)
    with torch.no_grad():
        reference(input_ids=probe)  # the root-only unit now holds unsharded weights: the sync must reshard first
    sync_reference_sharded(reference, policy, FSDP2)
    with torch.no_grad():
        results["reference_logits_vs_policy"] = float(
            (reference(input_ids=probe).logits - policy(input_ids=probe).logits).abs().max()
        )
    results["reference_vs_policy_gathered"] = max_diff(
        gathered_state_dict(reference, to_all_ranks=True), gathered_state_dict(policy, to_all_ranks=True)
    )
    # negative control: after a forward the root-only unit exposes its unsharded weights; a copy into those (instead
    # of resharding and editing the shards) is dropped at the next reshard, and the reference keeps the old weights
    stale, _ = build_tiny(seed=2)
    fully_shard(stale)
    with torch.no_grad():
        stale(input_ids=probe)
        results["unsharded_after_forward"] = not any(is_dtensor(p) for p in stale.parameters())
        for ref, pol in zip(stale.parameters(), policy.parameters()):
            ref.copy_(full_value(pol))
        reshard(stale)
        results["unsharded_copy_logits_vs_policy"] = float(
            (stale(input_ids=probe).logits - policy(input_ids=probe).logits).abs().max()
        )
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    leave_process_group()  # exiting with the group alive aborted rank 1 in ~1 run of 6 (gloo)


def frozen_float32(results: dict, probe: torch.Tensor) -> None:
    """Two frozen resets (`freeze_lora_delta` + `fresh_adapter_sharded`) on the sharded float32 model, each followed
    by a "trained" adapter (B != 0 again), against the same steps on the replica in one process."""
    sharded, _ = lora_model(seed_b=7, r=8, lora_alpha=16, target_modules="all-linear")
    single = copy.deepcopy(sharded)
    shard_like_accelerate(sharded)
    base_before = base_weights(sharded)
    record = {key: [] for key in ("reset_logits_max_abs_diff", "logits_vs_single", "factors_vs_single", "factor_hashes",
                                  "reports", "gathered_vs_single_merged", "gathered_vs_by_hand", "gathered_fp32_vs_single",
                                  "parts_per_layer")}  # fmt: skip
    for reset, seed in ((1, 99), (2, 100)):
        before = logits_of(sharded, probe)
        report = freeze_lora_delta(sharded, FSDP2)
        fresh_adapter_sharded(sharded, FSDP2, seed=seed)
        after = logits_of(sharded, probe)
        single_report = freeze_lora_delta(single)
        reinit_adapter(single, seed=seed)
        record["reset_logits_max_abs_diff"].append(float((after - before).abs().max()))
        record["logits_vs_single"].append(float((after - logits_of(single, probe)).abs().max()))
        factors = frozen_state_dict(sharded)
        record["factors_vs_single"].append(max_diff(factors, frozen_state_dict(single)))
        record["factor_hashes"].append(all_ranks(state_digest(factors)))
        record["reports"].append([[r.layers, r.rank_added, r.frozen_rank] for r in (report, single_report)])
        record["parts_per_layer"].append(sorted({len(f.scalings) for _, _, f in frozen_layers(sharded)}))
        # the next phase "trains": B != 0 again (the same in both), so the frozen and the live deltas are both folded
        set_lora_b_(sharded, seed=20 + reset, scale=0.1)
        set_lora_b_(single, seed=20 + reset, scale=0.1)
        gathered = gathered_state_dict(sharded, to_all_ranks=True)
        record["gathered_vs_single_merged"].append(max_diff(gathered, merged_state_dict(single)))
        by_hand = folded_by_hand(single)
        record["gathered_vs_by_hand"].append(max_diff({k: gathered[k] for k in by_hand}, by_hand))
        record["gathered_fp32_vs_single"].append(max_diff(
            gathered_state_dict(sharded, to_all_ranks=True, folded_dtype=torch.float32),
            merged_state_dict(single, folded_dtype=torch.float32),
        ))  # fmt: skip
    record["base_unchanged"] = max_diff(base_before, base_weights(sharded)) == 0.0
    results["frozen"] = record


def frozen_bf16(results: dict, probe: torch.Tensor) -> None:
    """A frozen reset on a bf16 base with float32 LoRA weights (PEFT's default) and a small delta, most of it under
    half a bf16 step of its weight (what a merge into bf16 rounds away; B = 1e-4 * randn): sharded with plain
    `fully_shard` (the live adapter computed in float32, as in one process) and as accelerate shards it under
    `mixed_precision: bf16` (`MixedPrecisionPolicy(param_dtype=bfloat16)`: the live adapter computed in bf16, the
    frozen factors in float32). The same run reset by a merge (`merge_lora_sharded`) for comparison."""
    out = {}
    accelerate_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for label, policy in (("plain", None), ("mixed_precision", accelerate_bf16)):
        sharded, _ = lora_model(
            seed_b=7, dtype=torch.bfloat16, b_scale=1e-4, r=8, lora_alpha=16, target_modules="all-linear"
        )
        merged, single = copy.deepcopy(sharded), copy.deepcopy(sharded)
        exact = copy.deepcopy(sharded).float()  # the same policy evaluated in float32
        shard_like_accelerate(sharded, policy)
        shard_like_accelerate(merged, policy)
        before = logits_of(sharded, probe)
        with sharded.disable_adapter():
            adapter_off = logits_of(sharded, probe)
        single_before = logits_of(single, probe)
        freeze_lora_delta(sharded, FSDP2)
        fresh_adapter_sharded(sharded, FSDP2, seed=99)
        after = logits_of(sharded, probe)
        freeze_lora_delta(single)
        reinit_adapter(single, seed=99)
        single_after = logits_of(single, probe)
        merge_before = logits_of(merged, probe)
        rounding = merge_lora_sharded(merged, FSDP2)
        fresh_adapter_sharded(merged, FSDP2, seed=99)
        merge_after = logits_of(merged, probe)

        def diff(a, b):
            return float((a - b).abs().max())

        out[label] = {
            "base_dtype": str(dict(sharded.named_parameters())["base_model.model.lm_head.weight"].dtype),
            "lora_dtype": str({p.dtype for n, p in sharded.named_parameters() if "lora_" in n}),
            "reset_change": diff(after, before),
            "one_process_reset_change": diff(single_after, single_before),
            "engine_vs_one_process_before": diff(before, single_before),
            "engine_vs_one_process_after": diff(after, single_after),
            "bf16_vs_float32": diff(before, logits_of(exact, probe)),
            "adapter_effect": diff(before, adapter_off),
            "factors_vs_one_process": max_diff(frozen_state_dict(sharded), frozen_state_dict(single)),
            "merge_reset_change": diff(merge_after, merge_before),
            "merge_lost_fraction": rounding.lost_fraction,
            "logits_max_abs": float(before.abs().max()),
        }
    results["bf16"] = out


@contextlib.contextmanager
def reference_forward(model: torch.nn.Module) -> Iterator[None]:
    """TRL's reference forward with a "ref" adapter (`trl.trainer.utils.use_adapter`), without importing TRL."""
    model.set_adapter("ref")
    try:
        yield
    finally:
        model.set_adapter("default")


def reference_only_reset(results: dict, probe: torch.Tensor) -> None:
    """The trainer's reset with `reset_adapter: false` (`trainer.hard_reset.run_hard_reset`, kind `REFERENCE`): TRL's
    "ref" adapter zeroed (`reset_reference_adapter`), the live delta copied for the reference alone
    (`snapshot_reference_delta`). Run after forwards, as training runs them: the root unit, which holds lm_head and
    its adapters, then keeps its unsharded weights, and a zero written there instead of into the shards would serve
    the next forward and vanish at the next reshard (the backward's), the reference back at the old adapter. Every
    rank measures; the same reset in one process is the expectation."""
    model, _ = lora_model(seed_b=7, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"])
    model.add_adapter("ref", model.peft_config["default"])
    with torch.no_grad():  # as TRL's GRPOTrainer builds it for a PeftModel with beta > 0: a copy of "default"
        for name, param in model.named_parameters():
            if ".default." in name:
                model.get_parameter(name.replace(".default.", ".ref.")).copy_(param)
    model.set_adapter("default")
    set_lora_b_(model, seed=8, scale=0.1)  # the policy has trained away from its reference
    single = copy.deepcopy(model)
    shard_like_accelerate(model)

    def reference_logits(m: torch.nn.Module) -> torch.Tensor:
        with reference_forward(m):
            return logits_of(m, probe)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    policy = logits_of(model, probe)
    before = reference_logits(model)
    root_ref_b = model.base_model.model.lm_head.lora_B["ref"].weight
    results["root_unsharded_before_reset"] = all_ranks(not is_dtensor(root_ref_b))
    reset_reference_adapter(model)  # what run_hard_reset calls for kind REFERENCE, in its order
    snapshot_reference_delta(model)
    right_after = reference_logits(model)
    reshard(model)  # as the next backward does: the forward after it gathers the shards
    after_reshard = reference_logits(model)
    reshard(model)
    results["ref_b_shards_zero"] = all_ranks(all(
        float(local_value(layer.lora_B["ref"].weight).abs().max()) == 0 for _, layer in lora_layers(model, "ref")
    ))  # fmt: skip
    batch = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 9, 60]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    policy_after_step = logits_of(model, probe)
    after_step = reference_logits(model)
    reset_reference_adapter(single)
    snapshot_reference_delta(single)
    results["reference_only"] = {
        "old_reference_vs_policy": all_ranks(diff(before, policy)),
        "right_after_vs_policy": all_ranks(diff(right_after, policy)),
        "after_reshard_vs_policy": all_ranks(diff(after_reshard, policy)),
        "after_step_vs_policy_at_reset": all_ranks(diff(after_step, policy)),
        "step_moved_policy": all_ranks(diff(policy_after_step, policy)),
        "vs_one_process": all_ranks(diff(after_reshard, reference_logits(single))),
        "factors_vs_one_process": all_ranks(max_diff(frozen_state_dict(model), frozen_state_dict(single))),
    }


def all_ranks(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])
    from _worker_exit import exit_without_finalization

    exit_without_finalization()
