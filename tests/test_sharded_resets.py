"""Hard resets under FSDP2 and DeepSpeed ZeRO-2/3 on CPU (2 gloo processes), and the launches that are refused.

* FSDP2 (tests/_fsdp2_worker.py): the mechanics on a model sharded with `fully_shard` as accelerate shards it,
  against the same operations in one process (accelerate runs FSDP only on accelerators; the trainer-level FSDP2
  runs are GPU runs: benchmarks/scale_out.py, tests/test_scale_out_gpu.py).
* ZeRO-2/3: whole ProRLTrainer runs under `accelerate launch --config_file recipes/accelerate/zero{2,3}.yaml`
  (benchmarks/scale_out.py --smoke: full fine-tuning, and LoRA with a shape change at each phase boundary reset both
  ways (frozen factors, the default, and a merge), an in-loop reset, a kill after reset 1 and a resume from disk).
  About 20 s (FSDP2) + 65 s (ZeRO: the two launches at once) on 2 idle cores.
"""

import json
import os

import pytest
import torch
from _benchmarks import load_benchmark
from test_ddp import WORKER as DDP_WORKER
from test_ddp import two_process_results

from prorl_trl.reset import (
    FSDP2,
    ZERO2,
    ZERO3,
    ResetNotSupportedError,
    check_reset_support,
    engine_of,
    superset_lora_config,
)

FSDP2_WORKER = DDP_WORKER.with_name("_fsdp2_worker.py")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return two_process_results(tmp_path_factory, FSDP2_WORKER, "fsdp2")


def test_fsdp2_weights_are_sharded_unevenly(fsdp2):
    assert fsdp2["weights_are_dtensors"]
    assert fsdp2["embedding_rows_per_rank"] == [133, 132]  # 265 rows over 2 ranks


def test_fsdp2_merge_and_fresh_adapter_match_one_process(fsdp2):
    assert fsdp2["gathered_vs_single_merged"] == 0.0  # gathered + folded delta == merged_state_dict of the replica
    assert fsdp2["merged_base_vs_single"] == 0.0  # merged shards == PEFT's merge in one process (fp32)
    assert fsdp2["fresh_adapter_vs_single_bitwise"] == 0.0  # same seeded A as reinit_adapter(seed=...), B = 0
    assert fsdp2["fresh_b_all_zero"]
    assert len(set(fsdp2["adapter_hash_per_rank"])) == 1
    assert fsdp2["reset_logits_max_abs_diff"] <= 1e-5  # fp32: the reset leaves the outputs unchanged
    assert fsdp2["load_state_roundtrip"] == 0.0
    # the merge's rounding report is summed over both ranks' rows: the same on each, and equal to one process's
    assert len(set(fsdp2["rounding_delta_sq_per_rank"])) == 1
    assert fsdp2["rounding_delta_sq_per_rank"][0] == pytest.approx(fsdp2["rounding_delta_sq_single"], rel=1e-6)
    assert fsdp2["rounding_lost_fraction_sharded_single"] == [0.0, 0.0]  # fp32: PEFT's merge and ours keep it all


def test_fsdp2_frozen_resets_match_one_process_and_change_nothing(fsdp2):
    """lora_reset_mode "frozen" (the default) on the sharded float32 model, two resets: the factors read from the
    shards are the replica's, bitwise and on every rank; no logit moves; the base shards are never written; the
    gathered policy (frozen parts + live delta folded) equals the replica's merged_state_dict and a fold by hand."""
    frozen = fsdp2["frozen"]
    assert frozen["reset_logits_max_abs_diff"] == [0.0, 0.0]
    assert frozen["logits_vs_single"] == [0.0, 0.0]
    assert frozen["factors_vs_single"] == [0.0, 0.0]
    assert all(len(set(hashes)) == 1 for hashes in frozen["factor_hashes"])
    assert frozen["reports"] == [[[14, 112, 8]] * 2, [[14, 112, 16]] * 2]  # 14 layers, rank 8 per reset
    assert frozen["parts_per_layer"] == [[1], [2]]
    assert frozen["base_unchanged"]
    assert frozen["gathered_vs_single_merged"] == [0.0, 0.0]
    assert frozen["gathered_fp32_vs_single"] == [0.0, 0.0]
    assert max(frozen["gathered_vs_by_hand"]) <= 1e-6  # float32 summation order only


def test_fsdp2_frozen_reset_on_a_bf16_base(fsdp2):
    """bf16 base, float32 LoRA weights, a small delta (a merge into bf16 rounds most of it away). The reset changes no
    logit bit, plain `fully_shard` or with accelerate's bf16 mixed precision, which hands the forward bf16 copies of
    the adapter: the frozen parts are computed in the dtype the live adapter computes in. Mixed precision's policy
    differs from one process's (float32 adapter products) by the same evaluation difference before and after the
    reset, within bf16 evaluation noise; plain, the two are bitwise equal."""
    plain, mixed = fsdp2["bf16"]["plain"], fsdp2["bf16"]["mixed_precision"]
    for case in (plain, mixed):
        assert (case["base_dtype"], case["lora_dtype"]) == ("torch.bfloat16", "{torch.float32}")
        assert case["factors_vs_one_process"] == 0.0
        assert case["one_process_reset_change"] == 0.0
        assert case["reset_change"] == 0.0
        assert case["merge_lost_fraction"] > 0.5  # the old merge: most of the delta rounded away ...
        assert case["merge_reset_change"] > 0.5 * case["adapter_effect"] > 0  # ... and most of its effect
        assert case["engine_vs_one_process_after"] == case["engine_vs_one_process_before"] <= case["bf16_vs_float32"]
    assert plain["engine_vs_one_process_before"] == 0.0


def test_fsdp2_frozen_reset_of_a_superset_adapter_keeps_only_the_active_part(fsdp2):
    """A shape change at a frozen reset: only the active layers (q, v) are frozen, at the active rank (4 of the 8
    allocated: B's zero columns are dropped), with the plain rank-4 adapter's factors; nothing moves."""
    assert fsdp2["superset_frozen_layers_are_targets"]
    assert fsdp2["superset_frozen_ranks"] == [4]
    assert fsdp2["superset_frozen_reports"] == [[4, 16, 4], [4, 16, 4]]  # 2 layers x (q, v), rank 4
    assert fsdp2["superset_frozen_vs_plain"] == 0.0
    assert fsdp2["superset_frozen_reset_logits_max_abs_diff"] <= 1e-6
    assert len(set(fsdp2["superset_frozen_hash_per_rank"])) == 1
    assert fsdp2["superset_all_linear_b_zero"]


def test_fsdp2_superset_adapter_is_the_smaller_adapter(fsdp2):
    # active rows == a plain rank-4 q,v adapter drawn with the same seed; everything else zero, and after an AdamW
    # step with weight decay the active part equals the plain adapter's and the rest is still exactly zero
    assert fsdp2["superset_active_vs_plain_bitwise"] == 0.0
    assert fsdp2["superset_inactive_max_abs"] == 0.0
    assert fsdp2["superset_after_step_active_vs_plain"] <= 1e-6
    assert fsdp2["superset_after_step_inactive_max_abs"] == 0.0
    assert fsdp2["optimizer_state_entries_before_after_reset"][0] > 0
    assert fsdp2["optimizer_state_entries_before_after_reset"][1] == 0


def test_fsdp2_reference_becomes_policy_and_resharding_matters(fsdp2):
    assert fsdp2["reference_vs_policy_gathered"] == 0.0
    assert fsdp2["reference_logits_vs_policy"] == 0.0
    # the trap the reshard avoids: edits to a root unit's unsharded weights vanish at the next reshard
    assert fsdp2["unsharded_after_forward"]
    assert fsdp2["unsharded_copy_logits_vs_policy"] > 1e-2


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="DeepSpeed runs need `DS_BUILD_OPS=0 pip install deepspeed`")
    out = tmp_path_factory.mktemp("zero")
    scale_out = load_benchmark("scale_out")
    code = scale_out.main(["--smoke", "--json-dir", str(out), "--budget", "900"])
    results = json.loads((out / "scale_out.json").read_text())
    return code, results, scale_out


@pytest.mark.parametrize("engine", ["zero3", "zero2"])
@pytest.mark.parametrize("mode", ["full", "lora", "lora_merge"])
def test_deepspeed_resets_keep_ranks_equal_outputs_and_resume(zero_runs, engine, mode):
    """`lora` runs the default frozen resets, `lora_merge` the merge into the base (lora_reset_mode "merge")."""
    code, results, scale_out = zero_runs
    (result,) = [r for r in results if r["engine"] == engine and r["mode"] == mode]
    assert "error" not in result, result.get("error")
    resets = result["resets"]
    assert [c["reset"] for c in resets] == [1, 2, 3] and [c["phase"] for c in resets] == [1, 2, 2]
    for check in resets:
        assert len(set(check["rank_hashes"])) == 1, check  # (a) every rank gathers the same weights
        assert len(set(check["frozen_hashes"])) == 1, check  # ... and holds the same frozen factors
        assert check["vs_merged_checkpoint"] == 0.0, check  # (a) == merged/reset-<k> read back from disk
        assert check["merged_save_dtypes"] == ["float32"], check
        assert check["masters_max_abs_diff"] == 0.0, check  # ZeRO's fp32 masters hold the edited weights
        assert check["logits_max_abs_diff"] <= 1e-5, check  # (b) fp32
        assert check["bf16_noise"] is not None and check["bf16_noise"] <= 1e-5, check  # float32 vs float32 here
        assert check["optimizer_state_entries"] == 0, check  # fresh Adam state
        if mode == "full":
            assert check["reference_vs_policy"] == 0.0, check  # reference := policy
            assert check["reset_mode"] is None and check["frozen_rank_total"] == 0, check
            assert check["merge_delta_lost"] is None, check  # nothing merged
            assert not check["base_moved"], check  # a full fine-tuning reset edits only the reference
        elif mode == "lora":  # the delta kept as frozen factors, the base weights never written
            assert check["reset_mode"] == "frozen" and check["merge_delta_lost"] is None, check
            assert not check["base_moved"], check
            assert check["frozen_rank_total"] > (64 if check["reset"] > 1 else 0), check
        else:  # fp32 masters in ZeRO's merge: the delta is kept to float32 rounding, in the base
            assert check["reset_mode"] == "merge" and check["frozen_rank_total"] == 0, check
            assert 0.0 <= check["merge_delta_lost"] <= 1e-6, check
            assert check["base_moved"], check
        if mode != "full":  # the trainer's own probe: the share of the adapter's effect on the log-probs lost
            assert check["reset_effect_lost"] is not None and check["reset_effect_lost"] <= 1e-3, check
    assert result.get("lora_reset_mode") == {"full": None, "lora": "frozen", "lora_merge": "merge"}[mode]
    if mode == "lora":  # reset 1 froze only the superset adapter's active part: r16 (of 32) on the 2 x (q, v) layers
        assert resets[0]["frozen_rank_total"] == 2 * 2 * 16
    resume = result["resume"]
    assert result["killed_in_phase"] == 1 and result["killed_after_resets"] == 1
    assert (resume["phase"], resume["resets"], resume["phase_step"]) == (1, 1, 1)  # (c) the right phase and step
    assert resume["hash"] == result["checkpoint_hash"]  # ... and the weights the checkpoint was written from
    assert (result["final_phase"], result["final_resets"]) == (2, 3)
    assert result["final_loads"] == "Qwen2ForCausalLM"
    assert scale_out.verdicts(result, smoke=True)["a"]


def test_deepspeed_smoke_run_passes_as_a_whole(zero_runs):
    code, results, _ = zero_runs
    assert code == 0 and len(results) == 6


# ---------------------------------------------------------------------------------------------- launch refusals
LAUNCH_ENV = (
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "FSDP_OFFLOAD_PARAMS",
)


@pytest.fixture
def launch_env(monkeypatch):
    """Set what `accelerate launch --config_file ...` exports (the other launch variables cleared); undone after."""

    def set_launch(**values):
        for name in LAUNCH_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    set_launch()
    return set_launch


def test_shipped_sharded_configs_are_supported(launch_env):
    import yaml

    root = os.path.join(os.path.dirname(__file__), "..", "recipes", "accelerate")
    for name, kind in (("zero2.yaml", ZERO2), ("zero3.yaml", ZERO3), ("fsdp.yaml", FSDP2)):
        config = yaml.safe_load(open(os.path.join(root, name)))
        if "deepspeed_config" in config:
            ds = config["deepspeed_config"]
            launch_env(
                ACCELERATE_USE_DEEPSPEED="true",
                ACCELERATE_DEEPSPEED_ZERO_STAGE=ds["zero_stage"],
                ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=ds["offload_optimizer_device"],
                ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE=ds["offload_param_device"],
            )
        else:
            fsdp = config["fsdp_config"]
            launch_env(
                ACCELERATE_USE_FSDP="true",
                FSDP_VERSION=fsdp["fsdp_version"],
                FSDP_OFFLOAD_PARAMS=str(fsdp["fsdp_offload_params"]).lower(),
            )
        assert engine_of(None).kind == kind, name
        check_reset_support(None, None)


@pytest.mark.parametrize(
    "env, args_deepspeed, message",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, None, "under FSDP1: FSDP version 1 flattens"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, None, "under FSDP2: FSDP2 with CPU offload"),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
             "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
            None,
            "under DeepSpeed ZeRO-3: CPU/NVMe offload \\(offload_optimizer=cpu",
        ),
        ({}, {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}, "a DeepSpeed `scheduler` block"),
        ({}, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "ZeRO\\+\\+ hierarchical"),
        ({}, {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
         "ZeRO stage 1 with bf16 and `data_types.grad_accum_dtype: fp32` \\(DeepSpeed's BF16_Optimizer"),
    ],
)  # fmt: skip
def test_unsupported_launches_are_refused_naming_what_works(launch_env, tmp_path, env, args_deepspeed, message):
    from trl import GRPOConfig

    launch_env(**env)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.deepspeed = args_deepspeed  # set after init: TrainingArguments would start DeepSpeed for a config
    with pytest.raises(ResetNotSupportedError, match=message) as error:
        check_reset_support(args, None)
    assert "Supported: single process" in str(error.value) and "zero3.yaml" in str(error.value)
    assert "fsdp.yaml" in str(error.value)


def test_zero1_is_refused_only_where_deepspeed_builds_its_bf16_optimizer(launch_env, tmp_path):
    """DeepSpeed swaps in its BF16_Optimizer for ZeRO-1 + bf16 + fp32 gradient accumulation, whose masters a phase
    boundary did not carry (the optimizer restarted silently, review of 2026-11-29); other ZeRO-1/2 setups pass."""
    from trl import GRPOConfig

    launch_env()
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    fp32_accumulation = {"data_types": {"grad_accum_dtype": "fp32"}}
    for config in ({"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
                   {"zero_optimization": {"stage": 1}, "bf16": {"enabled": False}, **fp32_accumulation},
                   {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, **fp32_accumulation}):  # fmt: skip
        args.deepspeed = config
        check_reset_support(args, None)


def test_trainer_refuses_before_loading_the_model(launch_env, tmp_path):
    """A refused launch fails in ProRLTrainer.__init__ before the model (here a path that does not exist) loads."""
    from prorl_trl.config import ProRLConfig
    from prorl_trl.trainer import ProRLTrainer

    def trainer(**config):
        args = ProRLConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                           num_generations=2, phases=[{"max_steps": 1}, {"max_steps": 1}], **config)  # fmt: skip
        return ProRLTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda **kw: [0.0], args=args)

    launch_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION="1")
    with pytest.raises(ResetNotSupportedError, match="FSDP1"):
        trainer()
    launch_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")  # FSDP2: supported, but compiled generation is not
    with pytest.raises(ValueError, match="compiled_generation is not supported under FSDP2"):
        trainer(compiled_generation=True)
    with pytest.raises(OSError):  # supported launch: the checks pass and only then does the (missing) model load
        trainer()
    launch_env()  # ZeRO-1's BF16_Optimizer: refused for phases without any reset too (each boundary keeps Adam)
    args = ProRLConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                       num_generations=2, phases=[{"max_steps": 1}, {"max_steps": 1}], hard_reset_between_phases=False)
    args.deepspeed = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                      "data_types": {"grad_accum_dtype": "fp32"}}  # fmt: skip
    with pytest.raises(ResetNotSupportedError, match="BF16_Optimizer"):
        ProRLTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda **kw: [0.0], args=args)


def test_superset_adapter_config():
    from peft import LoraConfig

    base = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    assert superset_lora_config(base, [(16, 32, ["v_proj", "q_proj"]), (16, 64, ["q_proj", "v_proj"])]) is None
    grown = superset_lora_config(base, [(16, 32, ["q_proj", "v_proj"]), (32, 64, ["k_proj"]), (8, 16, None)])
    assert (grown.r, set(grown.target_modules), grown.lora_alpha) == (32, {"q_proj", "k_proj", "v_proj"}, 32)
    assert base.r == 16 and base.target_modules == {"q_proj", "v_proj"}  # the caller's config is left alone
    assert superset_lora_config(base, [(16, 32, "all-linear")]).target_modules == "all-linear"
    with pytest.raises(ResetNotSupportedError, match="regular expression"):
        superset_lora_config(base, [(16, 32, r".*\.q_proj")])


def test_engine_from_the_accelerators_fsdp_plugin():
    """accelerate's FSDP2 plugin holds an `OffloadPolicy()` (truthy) when nothing is offloaded: not an offload.

    (A stand-in accelerator carries the real plugin: accelerate builds FSDP accelerators only on GPUs.)"""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    def accelerator(plugin):
        return SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))

    assert engine_of(None, accelerator(FullyShardedDataParallelPlugin(fsdp_version=2))).kind == FSDP2
    offloaded = engine_of(None, accelerator(FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)))
    assert offloaded.kind == "unsupported" and "CPU offload" in offloaded.problems[0]
    assert engine_of(None, accelerator(FullyShardedDataParallelPlugin(fsdp_version=1))).label == "FSDP1"


def test_preflight_reads_the_engine_of_each_shipped_launch_config():
    from pathlib import Path

    from prorl_trl.recipe.preflight import read_launch_config

    root = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"
    kinds = {name: read_launch_config(root / f"{name}.yaml").engine for name in
             ("zero2", "zero3", "fsdp", "multi_gpu", "single_gpu")}  # fmt: skip
    assert {name: engine.kind for name, engine in kinds.items()} == {
        "zero2": ZERO2, "zero3": ZERO3, "fsdp": FSDP2, "multi_gpu": "replicated", "single_gpu": "replicated",
    }  # fmt: skip
    assert not kinds["fsdp"].ram_efficient_loading  # every rank loads the whole checkpoint


def test_fsdp2_full_fine_tuning_with_a_reference_runs_unless_rank_0_loads_alone(tmp_path):
    """beta > 0 under FSDP2 is accepted (the reference is loaded on each process's device, trainer.placement), except
    with rank-0-only loading, where TRL's reference would miss accelerate's broadcast."""
    import dataclasses
    from pathlib import Path

    from prorl_trl import ProRLConfig, resolve_phases
    from prorl_trl.recipe.preflight import read_launch_config
    from prorl_trl.trainer.checks import check_launch

    root = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"
    fsdp = read_launch_config(root / "fsdp.yaml").engine
    args = ProRLConfig(output_dir=str(tmp_path), beta=0.04, use_cpu=True, report_to=[], compiled_generation=False)
    phases = resolve_phases(args)
    check_launch(args, fsdp, phases, model=None, peft_config=None, callbacks=[])
    rank_0_loading = dataclasses.replace(fsdp, ram_efficient_loading=True)
    with pytest.raises(ValueError, match="fsdp_cpu_ram_efficient_loading: false"):
        check_launch(args, rank_0_loading, phases, model=None, peft_config=None, callbacks=[])
    check_launch(args, rank_0_loading, phases, model=None, peft_config=object(), callbacks=[])  # LoRA: no reference model
    args.beta = 0.0
    check_launch(args, rank_0_loading, phases, model=None, peft_config=None, callbacks=[])


def test_fsdp2_models_load_on_the_process_device_and_strays_are_moved():
    """TRL keeps device_map="auto" under FSDP (test_trainer_internals); ProRLTrainer loads on the process's device
    unless the user chose a device_map, and strips dispatch hooks from the reference after TRL's init."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from prorl_trl.tiny import build_tiny
    from prorl_trl.trainer.placement import fsdp2_model_init_kwargs, move_stray_tensors_

    user = {"dtype": "bfloat16"}
    assert fsdp2_model_init_kwargs(user, torch.device("cuda:1")) == {"dtype": "bfloat16", "device_map": {"": "cuda:1"}}
    assert user == {"dtype": "bfloat16"}  # the caller's dict is not edited
    assert fsdp2_model_init_kwargs({"device_map": "auto"}, torch.device("cuda:1")) == {"device_map": "auto"}
    assert fsdp2_model_init_kwargs(None, torch.device("cpu")) == {}
    model, _ = build_tiny(seed=0)
    add_hook_to_module(model.model.layers[0], AlignDevicesHook(execution_device=torch.device("cpu")))
    assert move_stray_tensors_(model, torch.device("cpu")) == ["<accelerate dispatch hooks>"]
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    assert move_stray_tensors_(model, torch.device("cpu")) == []


def test_memory_runs_build_the_recipes_model_sizes():
    """The memory modes' random models have the published sizes (Qwen2.5-7B: 7.62B parameters; DeepSeek-R1-Distill-
    Qwen-1.5B: 1.78B), built on the meta device; the table names what each memory row measured."""
    from transformers import Qwen2ForCausalLM

    from prorl_trl.tiny import build_tiny

    scale_out = load_benchmark("scale_out")
    tokenizer = build_tiny()[1]
    sizes = {}
    for name, config in (("7b", scale_out.logic_rl_7b_config(tokenizer)), ("1.5b", scale_out.rlinf_15b_config(tokenizer))):
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert abs(sizes["7b"] / 1e9 - 7.62) < 0.01 and abs(sizes["1.5b"] / 1e9 - 1.78) < 0.01, sizes
    row = {"engine": "zero3", "processes": 2, "mode": "memory7b", "median_step_s": 1.0, "completions_per_s": 1.0,
           "peak_allocated_gb": 1.0, "peak_reserved_gb": 2.0}  # a rendering check, not a measurement
    assert "| zero3 | 2 | memory 7B full FT, beta 0.001 |" in scale_out.table([row], [], smoke=False, started=0.0)


def test_scale_out_driver_launches_on_its_own_gpus():
    """Two drivers can share a 4-GPU host: each launch takes the first N of its driver's `CUDA_VISIBLE_DEVICES`
    (all of the host's when unset), and a case that needs more GPUs than that is refused, not run on others."""
    scale_out = load_benchmark("scale_out")
    assert scale_out.launch_devices(2, None) == "0,1"
    assert scale_out.launch_devices(2, "2,3") == "2,3"
    assert scale_out.launch_devices(1, "3, 2") == "3"
    assert scale_out.launch_devices(4, "2,3") is None
    assert scale_out.launch_devices(1, "") is None  # no GPU visible


def test_float32_lora_cases_launch_without_mixed_precision_and_take_the_float32_bar(tmp_path):
    scale_out = load_benchmark("scale_out")
    assert {(e, n) for e, n, modes, _ in scale_out.GPU_CASES if modes == ("lora32",)} >= {
        ("zero3", 2), ("fsdp2", 2), ("zero3", 4), ("fsdp2", 4)}
    with pytest.raises(ValueError, match="without mixed precision"):
        scale_out.launch("zero3", 2, ("lora", "lora32"), False, tmp_path / "o", tmp_path / "w", 1, 8, tmp_path / "l")
    check = {"reset": 1, "phase": 1, "logits_max_abs_diff": 5e-5, "rank_hashes": ["x", "x"],
             "masters_max_abs_diff": 0.0, "vs_merged_checkpoint": 0.0, "merge_delta_lost": 0.0}
    for mode, passes in (("lora", True), ("lora32", False)):  # 5e-5: within bf16's 1e-2, over float32's 1e-5
        assert scale_out.verdicts({"mode": mode, "resets": [check]}, smoke=False)["b"] is passes


def test_bf16_reset_verdicts_take_the_noise_and_keep_the_merge_as_a_comparison():
    """(b) on a bf16 base passes at 1e-2 or when every reset moved the logits no more than the bf16 evaluation noise
    (engine logits vs the same policy in float32); a frozen reset must leave the base and every rank's factors equal;
    `lora_merge` is reported next to it without being required to pass (b). (Rendering checks, not measurements.)"""
    scale_out = load_benchmark("scale_out")
    check = {"reset": 1, "phase": 1, "rank_hashes": ["x", "x"], "frozen_hashes": ["f", "f"], "masters_max_abs_diff": 0.0,
             "vs_merged_checkpoint": 0.0, "merged_save_dtypes": ["float32"], "merge_delta_lost": None,
             "base_moved": False, "logits_max_abs_diff": 2e-2, "bf16_noise": 5e-2}  # fmt: skip
    frozen = {"engine": "zero3", "processes": 2, "mode": "lora", "lora_reset_mode": "frozen", "resets": [check]}
    verdict = scale_out.verdicts(frozen, smoke=False)
    assert verdict["a"] and verdict["b"] and verdict["within_noise"] and verdict["base_kept"]
    assert not scale_out.verdicts({**frozen, "resets": [{**check, "bf16_noise": 1e-2}]}, smoke=False)["b"]
    assert not scale_out.verdicts({**frozen, "resets": [{**check, "base_moved": True}]}, smoke=False)["a"]
    assert not scale_out.verdicts({**frozen, "resets": [{**check, "frozen_hashes": ["f", "g"]}]}, smoke=False)["a"]
    merge = {"engine": "zero3", "processes": 2, "mode": "lora_merge", "lora_reset_mode": "merge",
             "resets": [{**check, "base_moved": True, "logits_max_abs_diff": 0.15, "merge_delta_lost": 0.79}]}  # fmt: skip
    verdict = scale_out.verdicts(merge, smoke=False)
    assert verdict["a"] and not verdict["b"] and verdict["required"] == ("a", "c")
    text = scale_out.table([frozen, merge], [], smoke=False, started=0.0)
    assert "2.0e-02 ok (frozen; noise 5.0e-02, within)" in text and "base untouched" in text
    assert "1.5e-01 no (comparison) (merge; noise 5.0e-02; merge lost 79 % of the delta)" in text
