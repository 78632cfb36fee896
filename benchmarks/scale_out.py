"""Hard resets under FSDP2 and DeepSpeed ZeRO-3 (and ZeRO-2) on 1, 2 and 4 GPUs: correctness, resume, speed, memory.

    python benchmarks/scale_out.py --budget 560 --out benchmarks/results/scale_out.md   # GPU machine (4 GPUs)
    python benchmarks/scale_out.py --smoke                                             # CPU: ZeRO-2/3 over gloo

Every case is one `accelerate launch --config_file recipes/accelerate/<engine>.yaml --num_processes N` of this file
(`--worker`), the way a recipe is launched (single process for the 1-GPU baseline). A worker runs its modes in turn:

* `full` / `lora` / `lora_merge`: a 3-phase ProRLTrainer run with 3 hard resets (2 phase boundaries, 1 inside the
  last phase), on a Qwen2 model of Qwen2-0.5B's width with 8 of its 24 layers and the tiny tokenizer (random init,
  bf16, loaded by path as a recipe loads it). `full` trains all weights with a KL reference (beta 0.04), so each
  reset also sets reference := policy; `lora` changes the adapter at each reset (r16 on q,v -> r32 on all linear
  layers -> r16 on q,k,v,o), which FSDP2/ZeRO run as one superset adapter, and keeps each phase's delta as frozen
  float32 factors (`lora_reset_mode: frozen`, the default: the base weights are never written); `lora_merge` is the
  same run with `lora_reset_mode: merge` (the delta added into the bf16 base), for comparison. The run is killed (an
  exception on every rank) right after a checkpoint in phase 1, i.e. after reset 1, and a new trainer on a freshly
  loaded model resumes it from disk (`train(resume_from_checkpoint=True)`, frozen factors from `frozen/reset-1`) and
  runs to the end (reset 2, phase 2). At every reset the worker records (a) the gathered policy (every delta folded
  in float32): one hash per rank (must agree) and equality with `merged/reset-<k>/` read back from disk, compared in
  the save's dtype (`merged_save_dtype: auto` writes float32 when bf16 would round the deltas away); the frozen
  factors: one hash per rank (must agree); the base weights as stored: untouched by a frozen reset (a merge moves
  them); for full fine-tuning also reference == policy; under DeepSpeed, ZeRO's fp32 masters == the (edited)
  parameters; (b) max |logits after - logits before| on a fixed batch, next to the bf16 evaluation noise of that
  batch (max |engine logits - the same policy evaluated in float32 in one process|) and the trainer's own
  measures (`prorl/merge_delta_lost`: the share of the delta's norm the merge rounded away; `prorl/reset_effect_lost`:
  the share of the adapter's effect on the trained log-probs the reset changed); and (c) the phase, reset count and
  gathered-weight hash right after the resume vs at the checkpoint. Throughput: completions per second over the
  steps that are not the first of a `train()` call. On a bf16 base (b) passes at 1e-2 or within the bf16 noise;
  `lora_merge` is reported, not required to pass (b): the merge rounds most of a small delta away.
* `lora32`: `lora` on a float32 base, launched with `--mixed_precision no`: (b) against the float32 bar (1e-5) on the
  real engines.
* `memory`: full fine-tuning of the Qwen2.5-1.5B architecture (DeepSeek-R1-Distill-Qwen-1.5B, the RLinf recipe's
  model: hidden 1536, 28 layers, vocab 151,936, untied head), bf16, the RLinf recipe's micro-batch (8), optimizer
  and gradient checkpointing, completions forced to `--memory-tokens` tokens; 2 steps, no final merged save. Peak per-GPU
  `torch.cuda.max_memory_allocated` / `max_memory_reserved` (the largest rank).
* `memory7b`: the same for the Logic-RL recipe's full fine-tuning (`--peft.enabled false`, its README line): the
  Qwen2.5-7B architecture (hidden 3584, 28 layers, 4 KV heads, MLP 18,944, vocab 152,064, untied head), the recipe's
  micro-batch (4) and beta 0.001 (a reference model, sharded like the policy), so the figure includes the reference
  and the weights gathered for generation. On 2 GPUs the sharded training state alone is ~61 GB a GPU (16 bytes a
  parameter: bf16 weights and gradients + fp32 masters and Adam moments under ZeRO-3, fp32 weights, gradients and
  moments under FSDP2), before the reference, activations and gathers: it needs 2 x H200 (or 4 GPUs).

The driver runs the cases in priority order inside `--budget` seconds, writes every worker's JSON as it lands (and
`--json-dir`), skips what no longer fits, and prints one table (with the skipped cases) at the end. `--smoke` runs
ZeRO-2 and ZeRO-3 with 2 CPU processes on the tiny model in float32 (DeepSpeed over gloo; accelerate cannot run FSDP
on CPU), `full`, `lora` (frozen) and `lora_merge`.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import ROOT, device_name, fmt, utc_now  # first: the repository on sys.path

CONFIGS = {
    "zero3": "zero3.yaml",
    "zero2": "zero2.yaml",
    "fsdp2": "fsdp.yaml",
    "ddp": "multi_gpu.yaml",
    "single": "single_gpu.yaml",
}
# (engine, processes, modes, rough seconds on an H100 host): the order is the priority.
GPU_CASES = [
    ("zero3", 2, ("full", "lora", "lora_merge"), 130),
    ("fsdp2", 2, ("full", "lora", "lora_merge"), 130),
    ("single", 1, ("full", "lora", "lora_merge"), 105),
    ("zero3", 4, ("memory", "full", "lora"), 150),  # memory first: a fresh process measures only itself
    ("fsdp2", 4, ("memory", "full", "lora"), 150),
    ("ddp", 4, ("memory",), 150),  # hung in calls 6-7 (a save race, fixed: save_model_once); ran on 2 GPUs in call 8
    ("ddp", 2, ("memory",), 150),  # the same per-GPU figure where only 2 GPUs are lent (DDP replicates everything)
    ("zero2", 2, ("full", "lora"), 100),
    ("zero2", 4, ("full", "lora"), 110),
    ("zero3", 2, ("memory7b",), 420),  # needs 2 x H200 (see the module docstring)
    ("fsdp2", 2, ("memory7b",), 420),
    ("zero3", 4, ("memory7b",), 420),  # the Logic-RL recipe's 4 GPUs; fits 4 x H100
    ("fsdp2", 4, ("memory7b",), 420),
    ("zero3", 2, ("lora32",), 90),  # (b)'s float32 bar (1e-5) on the real engines: LoRA on a float32 base,
    ("fsdp2", 2, ("lora32",), 90),  # launched with --mixed_precision no
    ("zero3", 4, ("lora32",), 100),
    ("fsdp2", 4, ("lora32",), 100),
]
FLOAT32_MODES = ("lora32",)  # launched without mixed precision: a case holds only these or none of them
LORA_MODES = ("lora", "lora32", "lora_merge")
MERGE_MODES = ("lora_merge",)  # lora_reset_mode "merge": the old reset, run for comparison ((b) is not required)
SMOKE_CASES = [("zero3", 2, ("full", "lora", "lora_merge"), 240), ("zero2", 2, ("full", "lora", "lora_merge"), 240)]
STEPS_PER_PHASE = 3  # smoke: 2
EXPECTED_RESETS = 3  # two phase boundaries + one in-loop reset (HardResetCallback) in the last phase
LORA_PHASES = [  # r, alpha, targets: the shape changes at both resets
    (16, 32, ["q_proj", "v_proj"]),
    (32, 64, "all-linear"),
    (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"]),
]


class Killed(RuntimeError):
    """Raised on every rank right after the phase-1 checkpoint: the run dies there and is resumed from disk."""


# ------------------------------------------------------------------------------------------------------ worker
def small_config(tokenizer, smoke: bool):
    """Qwen2-0.5B's width with 8 of its 24 layers (the tiny test model in smoke mode); untied head."""
    from transformers import Qwen2Config

    from prorl_trl.tiny import tiny_config

    if smoke:
        return tiny_config(tokenizer)
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=8,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip


def _published_qwen2(tokenizer, layers: int, hidden: int, mlp: int, heads: int, kv_heads: int, vocab: int,
                     rope_theta: float, max_positions: int):
    """A Qwen2 config of a published model's sizes (untied head, RMSNorm eps 1e-6), the tiny tokenizer's special ids."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip


def rlinf_15b_config(tokenizer):
    """DeepSeek-R1-Distill-Qwen-1.5B's architecture (Qwen2.5-Math-1.5B), the RLinf recipe's model."""
    return _published_qwen2(tokenizer, layers=28, hidden=1536, mlp=8960, heads=12, kv_heads=2, vocab=151936,
                            rope_theta=10000.0, max_positions=131072)  # fmt: skip


def logic_rl_7b_config(tokenizer):
    """Qwen2.5-7B's architecture (the Logic-RL recipe's Qwen2.5-7B-Instruct-1M apart from its long-context RoPE)."""
    return _published_qwen2(tokenizer, layers=28, hidden=3584, mlp=18944, heads=28, kv_heads=4, vocab=152064,
                            rope_theta=1000000.0, max_positions=32768)  # fmt: skip


def save_model_once(config, tokenizer, path: Path, dtype, init_device: str = "cpu") -> str:
    """Rank 0 writes a random-init model + tokenizer to `path` (once per launch); every rank then loads it by path.
    `init_device="cuda"`: initialised on rank 0's GPU in `dtype` (a 7B model in float32 on the CPU takes minutes),
    then freed before anything is measured."""
    import torch
    from transformers import Qwen2ForCausalLM

    from accelerate import PartialState

    state = PartialState()  # joins this launch's process group now: a barrier before it is a no-op, and under DDP
    # rank 1 read the folder while rank 0 was still writing it (call 7: rank 1 died, rank 0 hung until the timeout)
    if state.is_main_process and not (path / "config.json").exists():
        with torch.random.fork_rng(devices=[] if init_device == "cpu" else None):
            torch.manual_seed(0)
            if init_device == "cpu":
                model = Qwen2ForCausalLM(config).to(dtype)
            else:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    with torch.device(init_device):
                        model = Qwen2ForCausalLM(config)
                finally:
                    torch.set_default_dtype(previous)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = config.pad_token_id, config.eos_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
        if init_device != "cpu":
            torch.cuda.empty_cache()
    state.wait_for_everyone()
    return str(path)


def state_hash(state: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def all_ranks(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0) for k in a)


def probe_logits(trainer, probe) -> "torch.Tensor":
    """Logits of the policy on a fixed batch (collective under FSDP2/ZeRO-3: every rank runs the same forward)."""
    import torch

    from prorl_trl.reset import unwrap_model

    model = unwrap_model(trainer.model)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe.to(trainer.accelerator.device)).logits.float().cpu()
    model.train(was_training)
    return logits


def masters_match(trainer) -> float | None:
    """Under DeepSpeed: max |fp32 master - parameter| over trainable parameters (collective); None otherwise."""
    if not trainer._engine.deepspeed or trainer.optimizer is None:
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    from prorl_trl.reset import unwrap_model
    from prorl_trl.reset.engine import gathered

    worst = 0.0
    for _, param in unwrap_model(trainer.model).named_parameters():
        if not param.requires_grad:
            continue
        master = safe_get_full_fp32_param(param)
        if master is None:
            continue
        with gathered([param]):
            worst = max(worst, float((master.float().cpu() - param.detach().float().cpu()).abs().max()))
    return worst


def base_hash(trainer) -> str:
    """Hash of the policy's base weights as the engine stores them (no LoRA tensors, no delta folded), each gathered
    whole; collective under FSDP2/ZeRO-3. A frozen reset leaves it as it was; a merge changes it."""
    import torch

    from prorl_trl.reset import unwrap_model
    from prorl_trl.reset.engine import full_value, gathered, reshard

    model = unwrap_model(trainer.model)
    reshard(model)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        with gathered([param]):
            value = full_value(param).detach().to("cpu", copy=True)
        digest.update(name.encode())
        digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def float32_logits(trainer, probe, cache: dict):
    """The policy (every delta folded in float32) evaluated in float32 in one plain model on rank 0's CPU (no TF32, and
    no GPU memory in the peaks): the reference the bf16 evaluation noise is measured against. Collective (the
    gather); rank 0 gets the logits, the others None. The plain model is built once per run (`cache`) by its
    constructor, which (unlike `from_pretrained`) does not enter ZeRO-3's `zero.Init`."""
    import copy

    import torch
    from transformers import Qwen2ForCausalLM

    from prorl_trl.reset import gathered_state_dict
    from prorl_trl.reset.support import base_model_of

    state = gathered_state_dict(trainer.model, folded_dtype=torch.float32)
    if state is None:
        return None
    if "model" not in cache:
        config = copy.deepcopy(base_model_of(trainer.model).config)
        config._attn_implementation = "sdpa"  # on the CPU, whatever kernel the engine's model uses
        cache["model"] = Qwen2ForCausalLM(config).float().eval()
    model = cache["model"]
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    with torch.no_grad():
        return model(input_ids=probe.cpu()).logits.float()


def run_mode(mode: str, engine: str, smoke: bool, workdir: Path, tokenizer) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from prorl_trl.config import ProRLConfig
    from prorl_trl.reset import frozen_rank_total, frozen_state_dict, gathered_state_dict, unwrap_model
    from prorl_trl.trainer import ProRLTrainer
    from prorl_trl.trainer.callbacks import HardResetCallback

    device_type = "cpu" if smoke else "cuda"
    float32 = smoke or mode in FLOAT32_MODES
    dtype = torch.float32 if float32 else torch.bfloat16
    memory = mode in ("memory", "memory7b")
    lora = mode in LORA_MODES
    reset_mode = "merge" if mode in MERGE_MODES else "frozen"  # ProRLConfig.lora_reset_mode
    if smoke or not memory:
        folder = "model-small-fp32" if float32 and not smoke else "model-small"
        config, init_device = small_config(tokenizer, smoke), "cpu"
    elif mode == "memory":
        config, folder, init_device = rlinf_15b_config(tokenizer), "model-1.5b", "cpu"
    else:
        config, folder, init_device = logic_rl_7b_config(tokenizer), "model-7b", device_type
    model_path = save_model_once(config, tokenizer, workdir / folder, dtype, init_device)
    out_dir = workdir / f"run-{mode}"
    probe = torch.tensor([tokenizer.encode("Question 7: add 7 and 10. Answer:")] * 2)
    record: dict = {"mode": mode, "resets": [], "step_s": [], "resume": None, "errors": []}
    if lora:
        record["lora_reset_mode"] = reset_mode
    float32_model: dict = {}  # the float32 evaluation model (rank 0), built at the first reset

    class Probe(TrainerCallback):
        def __init__(self, kill: bool):
            self.kill, self.trainer, self._t, self.first = kill, None, None, True

        def on_train_begin(self, args, state, control, **kwargs):
            self.first = True
            trainer = self.trainer
            if trainer._resumed_phase_step and record["resume"] is None:  # right after HF loaded the checkpoint
                state_dict = gathered_state_dict(trainer.model, to_all_ranks=True)
                record["resume"] = {"phase": trainer.current_phase.index, "resets": trainer.prorl_resets,
                                    "phase_step": trainer._resumed_phase_step, "hash": all_ranks(state_hash(state_dict))}

        def on_step_begin(self, args, state, control, **kwargs):
            if self.kill and self.trainer.current_phase.index == 1 and state.global_step == 1:
                raise Killed("killed after the phase-1 checkpoint")
            if device_type == "cuda":
                torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device_type == "cuda":
                torch.cuda.synchronize()
            if not self.first:
                record["step_s"].append(time.perf_counter() - self._t)
            self.first = False
            if self.kill and self.trainer.current_phase.index == 1 and state.global_step == 1:
                control.should_save = True
            return control

        def on_save(self, args, state, control, **kwargs):
            if self.kill:
                record["checkpoint_hash"] = all_ranks(state_hash(gathered_state_dict(self.trainer.model, to_all_ranks=True)))

    class CheckedTrainer(ProRLTrainer):
        def _save_final(self) -> None:
            if not memory:  # the memory runs measure training; a 1.5B merged save would only cost device time
                super()._save_final()

        def hard_reset(self, reason: str = "manual", lora_phase=None) -> None:
            before = probe_logits(self, probe)
            exact = float32_logits(self, probe, float32_model)  # rank 0 only
            base_before = base_hash(self)
            super().hard_reset(reason=reason, lora_phase=lora_phase)
            after = probe_logits(self, probe)
            # every delta folded in float32, as merged saves fold them (then written in merged_save_dtype)
            policy = gathered_state_dict(self.model, to_all_ranks=True, folded_dtype=torch.float32)
            model = unwrap_model(self.model)
            check = {"reset": self.prorl_resets, "phase": (lora_phase or self.current_phase).index,
                     "logits_max_abs_diff": float((after - before).abs().max()),
                     "logits_max_abs": float(before.abs().max()),
                     "bf16_noise": None if exact is None else float((before - exact).abs().max()),
                     "reset_mode": reset_mode if lora else None,
                     "merge_delta_lost": self.prorl_merge_delta_lost,  # None for full fine-tuning and frozen resets
                     "reset_effect_lost": self.prorl_reset_change.get("prorl/reset_effect_lost"),
                     "reset_logp_change": self.prorl_reset_change.get("prorl/reset_logp_change"),
                     "rank_hashes": all_ranks(state_hash(policy)),
                     "frozen_hashes": all_ranks(state_hash(frozen_state_dict(model))),
                     "frozen_rank_total": frozen_rank_total(model),
                     "base_moved": base_hash(self) != base_before,
                     "masters_max_abs_diff": masters_match(self)}  # fmt: skip
            check["bf16_noise"] = all_ranks(check["bf16_noise"])[0]
            if self.prorl_merged_path and self.accelerator.is_main_process:
                saved = load_file(str(Path(self.prorl_merged_path) / "model.safetensors"))
                check["merged_save_dtypes"] = sorted({str(v.dtype).removeprefix("torch.") for v in saved.values()})
                in_saved_dtype = {k: v.to(saved[k].dtype) if k in saved else v for k, v in policy.items()}
                check["vs_merged_checkpoint"] = max_abs_diff(in_saved_dtype, saved)
            if self.ref_model is not None:  # in the reference's dtype (FSDP2 keeps the policy's trainable weights in fp32)
                reference = gathered_state_dict(self.ref_model, to_all_ranks=True)
                check["reference_vs_policy"] = max_abs_diff(reference, {k: v.to(reference[k].dtype) for k, v in policy.items() if k in reference})
            opt = self.optimizer
            check["optimizer_state_entries"] = None if opt is None else len(reset_base(opt).state)
            record["resets"].append(check)

    def reset_base(optimizer):
        from prorl_trl.reset.optimizer import base_optimizer

        return base_optimizer(optimizer)

    def reward(completion_ids, **kwargs):
        return [(sum(ids) % 13) / 13 for ids in completion_ids]

    per_device = 4 if mode == "memory7b" and not smoke else 8 if (memory or not smoke) else 2  # the recipes' micro-batches
    completion = (args_cli.memory_tokens if memory else 32) if not smoke else 6
    steps = 2 if memory or smoke else STEPS_PER_PHASE
    phases = [{"name": f"phase-{i}", "max_steps": steps} for i in range(1 if memory else 3)]
    in_loop = [] if memory else [HardResetCallback(every_steps=3 * steps - 1)]  # the last phase's next-to-last step
    if lora:
        for phase, (r, alpha, targets) in zip(phases, LORA_PHASES):
            phase.update(lora_r=r, lora_alpha=alpha, lora_target_modules=targets)

    def make_trainer(kill: bool):
        callback = Probe(kill)
        if smoke:  # the configured gloo state is kept; the previous trainer's DeepSpeed plugin is not
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()
        args = ProRLConfig(
            output_dir=str(out_dir), per_device_train_batch_size=per_device, num_generations=per_device,
            max_completion_length=completion, generation_kwargs={"min_new_tokens": completion},
            learning_rate=(2e-6 if memory else 1e-5) if not lora else 1e-4,
            beta={"memory": 0.0, "memory7b": 0.001}.get(mode, 0.0 if lora else 0.04), logging_steps=1,
            lora_reset_mode=reset_mode,
            save_strategy="no", report_to=[],
            bf16=not float32, gradient_checkpointing=memory, disable_tqdm=True, seed=0, phases=phases,
            model_init_kwargs={"dtype": dtype}, ddp_timeout=180,
            accelerator_config={"use_configured_state": True} if smoke else None,
            **({"weight_decay": 0.01, "adam_beta2": 0.95, "max_grad_norm": 1.0} if memory else {}),
        )  # fmt: skip
        trainer = CheckedTrainer(
            model=model_path, reward_funcs=reward, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(256)]}),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
            if lora else None,
            callbacks=[callback, *in_loop],
        )  # fmt: skip
        callback.trainer = trainer
        return trainer

    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = make_trainer(kill=not memory)
    record["engine_detected"] = trainer._engine.label
    try:
        trainer.train()
    except Killed:
        record["killed_in_phase"] = trainer.current_phase.index
        record["killed_after_resets"] = trainer.prorl_resets
        trainer.accelerator.free_memory()
        del trainer
        gc.collect()
        trainer = make_trainer(kill=False)
        trainer.train(resume_from_checkpoint=True)
    record["final_resets"] = trainer.prorl_resets
    record["final_phase"] = trainer.current_phase.index
    record["completions_per_step"] = per_device * trainer.accelerator.num_processes * trainer.args.gradient_accumulation_steps
    steady = record["step_s"]
    record["median_step_s"] = max(all_ranks(statistics.median(steady))) if steady else None
    record["completions_per_s"] = record["completions_per_step"] / record["median_step_s"] if steady else None
    if device_type == "cuda":
        record["peak_allocated_gb"] = max(all_ranks(torch.cuda.max_memory_allocated() / 1e9))
        record["peak_reserved_gb"] = max(all_ranks(torch.cuda.max_memory_reserved() / 1e9))
    if not memory:
        record["final_dir"] = str(out_dir / "final")  # the driver loads it (a load here would enter ZeRO-3's zero.Init)
    trainer.accelerator.free_memory()
    return record


def worker(args) -> None:
    import torch

    if args.smoke:
        torch.set_num_threads(1)
        from accelerate import PartialState

        PartialState(backend="gloo")  # accelerate picks NCCL from a GPU; on CPU DeepSpeed needs gloo handed to it
    from prorl_trl.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    workdir = Path(args.workdir)
    rank = int(os.environ.get("RANK", 0))
    for mode in args.modes.split(","):
        result = {"engine": args.engine, "processes": int(os.environ.get("WORLD_SIZE", 1)), "mode": mode}
        started = time.time()
        try:
            result.update(run_mode(mode, args.engine, args.smoke, workdir, tokenizer))
        except Exception as error:  # keep the other modes; the table shows the error
            import traceback

            result["error"] = f"{type(error).__name__}: {error}"[:600]
            traceback.print_exc()
        if torch.cuda.is_available():
            result["device"] = device_name()
        result["wall_s"] = round(time.time() - started, 1)
        if rank == 0:
            print(f"[scale_out] {args.engine} x{result['processes']} {mode}: {result['wall_s']} s, "
                  f"{'error: ' + result['error'] if 'error' in result else 'done'}", flush=True)
            with open(args.worker, "a") as handle:
                handle.write(json.dumps(result) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------ driver
def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together while chosen, so launches started at once never share one)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def launch_devices(processes: int, visible: str | None) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for one launch: the first `processes` of the GPUs this driver may use (all of the host's
    when unset), so two drivers can share a 4-GPU host; None when fewer are visible."""
    devices = [str(i) for i in range(processes)] if visible is None else [d for d in visible.split(",") if d.strip()]
    return ",".join(devices[:processes]) if len(devices) >= processes else None


def launch(engine: str, processes: int, modes: tuple, smoke: bool, out: Path, workdir: Path, timeout: float,
           memory_tokens: int, log: Path, port: int | None = None) -> str | None:
    """One `accelerate launch` of the worker, its output in `log`; returns None, or why it failed (and prints the
    log's tail)."""
    script = str(Path(__file__).resolve())
    tail = [script, "--worker", str(out), "--engine", engine, "--modes", ",".join(modes), "--workdir", str(workdir),
            "--memory-tokens", str(memory_tokens)] + (["--smoke"] if smoke else [])  # fmt: skip
    config = ROOT / "recipes" / "accelerate" / CONFIGS[engine]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(processes), "--main_process_port", str(port or free_port())]  # fmt: skip
    float32 = [mode in FLOAT32_MODES for mode in modes]
    if any(float32) and not all(float32):
        raise ValueError(f"A case runs {FLOAT32_MODES} without mixed precision and nothing else; got {modes}.")
    command += ["--mixed_precision", "no"] if smoke or all(float32) else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if not smoke:
        devices = launch_devices(processes, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if devices is None:
            return f"needs {processes} GPUs, CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} lists fewer"
        env["CUDA_VISIBLE_DEVICES"] = devices
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"$ [{engine} x{processes} {','.join(modes)}]", " ".join(command + tail), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        try:
            completed = subprocess.run(command + tail, env=env, timeout=timeout, start_new_session=True,
                                       stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
            failure = None if completed.returncode == 0 else f"exit status {completed.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
    if failure:
        print(f"[{engine} x{processes}] {failure}; last lines of {log}:", *log.read_text().splitlines()[-30:], sep="\n")
    return failure


def load_final(path: Path) -> str:
    """`<output_dir>/final` through `AutoModelForCausalLM.from_pretrained` (in this process: no engine state)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            finite = bool(torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all())
        return f"{type(model).__name__}{'' if finite else ' (non-finite logits)'}"
    except Exception as error:  # reported in the table
        return f"NO: {type(error).__name__}: {error}"[:200]


def verdicts(result: dict, smoke: bool) -> dict:
    """(a), (b), (c) per mode: yes/NO with the numbers behind them."""
    resets = result.get("resets", [])
    float32 = smoke or result.get("mode") in FLOAT32_MODES
    tol = 1e-5 if float32 else 1e-2
    ranks_equal = all(len(set(c["rank_hashes"])) == 1 for c in resets)
    frozen_equal = all(len(set(c.get("frozen_hashes", [None]))) == 1 for c in resets)
    merging = result.get("mode") in MERGE_MODES
    base_kept = all(not c.get("base_moved") for c in resets) if not merging else None  # a merge moves the base
    noise = [c.get("bf16_noise") for c in resets]
    within_noise = None  # every reset moved the logits no more than the bf16 noise of its batch (None: not measured)
    if resets and None not in noise:
        within_noise = all(c["logits_max_abs_diff"] <= n for c, n in zip(resets, noise))
    effect = [c["reset_effect_lost"] for c in resets if c.get("reset_effect_lost") is not None]
    vs_saved = max((c.get("vs_merged_checkpoint", 0.0) for c in resets), default=None)
    ref = max((c.get("reference_vs_policy", 0.0) for c in resets), default=None)
    masters = [c["masters_max_abs_diff"] for c in resets if c.get("masters_max_abs_diff") is not None]
    logits = max((c["logits_max_abs_diff"] for c in resets), default=None)
    lost = [c["merge_delta_lost"] for c in resets if c.get("merge_delta_lost") is not None]
    resume = result.get("resume") or {}
    resumed_ok = (
        bool(resume) and resume.get("phase") == 1 and resume.get("resets") == 1
        and resume.get("hash") == result.get("checkpoint_hash") and len(set(resume.get("hash", [None]))) == 1
    )  # fmt: skip
    return {
        "a": bool(resets) and ranks_equal and frozen_equal and base_kept is not False and vs_saved == 0.0
        and (ref in (None, 0.0)) and all(m == 0.0 for m in masters),
        # bf16: the bar, or every reset within the bf16 evaluation noise of its batch (the GPU acceptance)
        "b": logits is not None and (logits <= tol or (not float32 and within_noise is True)),
        "required": ("a", "c") if merging else ("a", "b", "c"),  # the merge is run for comparison
        "within_noise": within_noise, "noise": max((n for n in noise if n is not None), default=None),
        "effect_lost": max(effect) if effect else None, "base_kept": base_kept,
        "reset_mode": result.get("lora_reset_mode"),
        "c": resumed_ok and result.get("final_phase") == 2 and result.get("final_resets") == EXPECTED_RESETS,
        "logits": logits, "merge_lost": max(lost) if lost else None, "vs_saved": vs_saved, "ref": ref,
        "masters": max(masters) if masters else None,
        "n_resets": len(resets),
    }  # fmt: skip


def table(results: list[dict], skipped: list[str], smoke: bool, started: float) -> str:
    devices = sorted({r.get("device", "CPU") for r in results}) or ["(none)"]
    lines = [
        f"Device: {', '.join(devices)} | {utc_now()} | "
        f"{time.time() - started:.0f} s",
        "",
        "| engine | GPUs | mode | resets checked | (a) ranks equal, = merged save, ref = policy, masters, base | (b) max abs "
        "dlogits (bf16 noise; share of the delta / of its effect lost) | (c) kill + resume | median step (s) "
        "| completions/s | scaling eff. | peak alloc / reserved GB |",
        "|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    baseline = {r["mode"]: r.get("completions_per_s") for r in results if r["engine"] == "single"}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['processes']} | {r['mode']} | ERROR: {r['error'][:160]} |||||||")
            continue
        if r["mode"] in ("memory", "memory7b"):
            model = "1.5B full FT" if r["mode"] == "memory" else "7B full FT, beta 0.001"
            lines.append(
                f"| {r['engine']} | {r['processes']} | memory {model} | - | - | - | - | {fmt(r.get('median_step_s'))} | "
                f"{fmt(r.get('completions_per_s'), '.1f')} | - | {fmt(r.get('peak_allocated_gb'), '.1f')} / "
                f"{fmt(r.get('peak_reserved_gb'), '.1f')} |"
            )
            continue
        v = verdicts(r, smoke)
        base = baseline.get(r["mode"])
        cps = r.get("completions_per_s")
        eff = cps / (r["processes"] * base) if (cps and base) else None
        saved_dtypes = sorted({d for c in r.get("resets", []) for d in c.get("merged_save_dtypes", [])})
        a_detail = f"saved {fmt(v['vs_saved'], '.1e')}{' in ' + '/'.join(saved_dtypes) if saved_dtypes else ''}, " \
                   f"ref {fmt(v['ref'], '.1e')}, masters {fmt(v['masters'], '.1e')}"  # fmt: skip
        if v["base_kept"] is not None and v["reset_mode"] is not None:
            a_detail += ", base untouched" if v["base_kept"] else ", base MOVED"
        b_detail = [v["reset_mode"]] if v["reset_mode"] else []
        if v["noise"] is not None:
            b_detail.append(f"noise {v['noise']:.1e}{', within' if v['within_noise'] else ''}")
        if v["merge_lost"] is not None:
            b_detail.append(f"merge lost {100 * v['merge_lost']:.0f} % of the delta")
        if v["effect_lost"] is not None:
            b_detail.append(f"effect lost {100 * v['effect_lost']:.0f} %")
        b_mark = "ok" if v["b"] else ("NO" if "b" in v["required"] else "no (comparison)")
        lines.append(
            f"| {r['engine']} | {r['processes']} | {r['mode']} | {v['n_resets']} | {'yes' if v['a'] else 'NO'} ({a_detail}) | "
            f"{fmt(v['logits'], '.1e')} {b_mark}{' (' + '; '.join(b_detail) + ')' if b_detail else ''} | "
            f"{'yes' if v['c'] else 'NO'} | "
            f"{fmt(r.get('median_step_s'))} | {fmt(cps, '.1f')} | {fmt(eff)} | "
            f"{fmt(r.get('peak_allocated_gb'), '.1f')} / {fmt(r.get('peak_reserved_gb'), '.1f')} |"
        )
    if skipped:
        lines += ["", "Skipped (budget): " + "; ".join(skipped)]
    return "\n".join(lines)


def run_case(case: tuple, tmp: str, started: float, port: int | None = None) -> tuple[list[dict], str | None]:
    """One case's launch: (its results, every mode present, an error where it wrote none; or the case skipped)."""
    engine, processes, modes, estimate = case
    left = args_cli.budget - (time.time() - started)
    if left < min(estimate, 60) or (not args_cli.smoke and left < 0.6 * estimate):
        return [], f"{engine} x{processes} ({','.join(modes)})"
    name = f"{engine}-{processes}" + ("-fp32" if set(modes) <= set(FLOAT32_MODES) else "")  # one per case
    out = Path(tmp) / f"{name}.jsonl"
    timeout = min(left - 5, 2.5 * estimate)  # a hung collective must not eat the rest of the budget
    log = (args_cli.json_dir or Path(tmp)) / f"{name}.log"
    failure = launch(engine, processes, modes, args_cli.smoke, out, Path(tmp) / f"work-{name}",
                     timeout, args_cli.memory_tokens, log, port)  # fmt: skip
    landed = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    for mode in modes:
        if not any(r["mode"] == mode for r in landed):
            landed.append({"engine": engine, "processes": processes, "mode": mode,
                           "error": f"no result ({failure or 'worker wrote nothing'})"})  # fmt: skip
    for result in landed:
        if result.get("final_dir"):
            result["final_loads"] = load_final(Path(result.pop("final_dir")))
    return landed, None


def main(argv: list[str] | None = None) -> int:
    global args_cli
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, ZeRO-2/3 over gloo, 2 processes.")
    parser.add_argument("--budget", type=float, default=560.0, help="Seconds for the whole matrix (cases that no "
                        "longer fit are skipped and listed).")  # fmt: skip
    parser.add_argument("--cases", default=None, help="Comma list of engine:processes (default: the whole matrix).")
    parser.add_argument("--memory-tokens", type=int, default=128, help="Completion tokens in the memory runs.")
    parser.add_argument("--out", type=Path, default=None, help="Also write the table (and raw JSON) here.")
    parser.add_argument("--json-dir", type=Path, default=None, help="Copy every worker's JSON lines and its output log here.")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--modes", default=None,
                        help="Comma list of modes to keep (full, lora, lora_merge, lora32, memory, memory7b).")  # fmt: skip
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args_cli = parser.parse_args(argv)
    if args_cli.worker:
        worker(args_cli)
        return 0
    started = time.time()
    cases = SMOKE_CASES if args_cli.smoke else GPU_CASES
    if args_cli.cases:
        wanted = args_cli.cases.split(",")
        cases = [c for c in cases if f"{c[0]}:{c[1]}" in wanted]
    if args_cli.modes:  # e.g. only "lora" in a short call
        cases = [(e, n, tuple(m for m in args_cli.modes.split(",") if m in modes), t) for e, n, modes, t in cases]
        cases = [c for c in cases if c[2]]
    results, skipped = [], []

    def record(landed: list[dict], skip: str | None) -> None:  # after each case: a later case's hang loses nothing
        results.extend(landed)
        skipped.extend([skip] if skip else [])
        if args_cli.json_dir:
            args_cli.json_dir.mkdir(parents=True, exist_ok=True)
            (args_cli.json_dir / "scale_out.json").write_text(json.dumps(results, indent=1))
        print(table(results, skipped, args_cli.smoke, started), flush=True)

    with tempfile.TemporaryDirectory(prefix="scale_out_") as tmp:
        if args_cli.smoke:  # CPU cases at once: their gloo ranks wait on each other most of the time, so two launches
            # fill two cores where one left them half idle (ZeRO-2 then ZeRO-3 took 72 s on 2 idle cores)
            ports = free_ports(len(cases))
            with ThreadPoolExecutor(max(len(cases), 1)) as pool:
                for outcome in list(pool.map(lambda case, port: run_case(case, tmp, started, port), cases, ports)):
                    record(*outcome)
        else:  # GPU cases take the GPUs in turn, each within what is left of the budget
            for case in cases:
                record(*run_case(case, tmp, started))
    text = table(results, skipped, args_cli.smoke, started)
    print(text)
    if args_cli.out:
        args_cli.out.parent.mkdir(parents=True, exist_ok=True)
        args_cli.out.write_text(text + "\n\nRaw:\n\n```json\n" + json.dumps(results, indent=1) + "\n```\n")
    ok = [verdicts(r, args_cli.smoke) for r in results if "error" not in r and not r["mode"].startswith("memory")]
    passed = ok and all(all(v[key] for key in v["required"]) for v in ok)
    return 0 if passed and not any("error" in r for r in results) else 1


args_cli = None

if __name__ == "__main__":
    raise SystemExit(main())
