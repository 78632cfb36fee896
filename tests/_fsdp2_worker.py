"""Worker for tests/test_sharded_resets.py: the FSDP2 reset mechanics on 2 CPU processes (gloo), against one process.

Run as `torchrun --nproc_per_node 2 tests/_fsdp2_worker.py OUT.json`. accelerate runs FSDP only on accelerators, so
the model is sharded here the way accelerate's `fsdp2_prepare_model` does it (`fully_shard` on every decoder layer,
then on the root; the reference root-only, as TRL's `prepare_fsdp`); every rank also keeps an unsharded copy that
the same operations run on in one process. The tiny model's vocabulary (265 rows) is not divisible by 2, so one
shard is a row shorter. Rank 0 writes what it measured; the test asserts on it.
"""

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer  # noqa: E402

from prorl_trl.recipe.run import leave_process_group  # noqa: E402
from prorl_trl.reset import (  # noqa: E402
    FSDP2,
    fresh_adapter_sharded,
    gathered_state_dict,
    load_state_,
    lora_layers,
    merge_lora_in_place,
    merge_lora_sharded,
    merged_state_dict,
    reinit_adapter,
    reset_optimizer_state,
    sync_reference_sharded,
    targeted_module_names,
)
from prorl_trl.reset.engine import full_value, is_dtensor, reshard, write_full_  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402


def shard_like_accelerate(model):
    for module in model.modules():
        if isinstance(module, Qwen2DecoderLayer):
            fully_shard(module)
    fully_shard(model)
    return model


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def lora_model(seed_b: int, **config):
    model, tokenizer = build_tiny(seed=0)
    with torch.random.fork_rng(devices=[]):  # the same replica on every rank before sharding (as after a broadcast)
        torch.manual_seed(0)
        peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **config))
    generator = torch.Generator().manual_seed(seed_b)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        for _, layer in lora_layers(peft):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return peft, tokenizer


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(1234 + dist.get_rank())  # each rank's global RNG differs, as under TRL's device-specific seed
    torch.set_num_threads(1)
    results = {}
    probe = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])

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


def all_ranks(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
