"""Worker for tests/test_ddp.py: a 3-phase LoRA GRPO run under 2-process DDP (gloo, CPU) with hard resets.

Run as `torchrun --nproc_per_node 2 tests/_ddp_worker.py OUT.json`. Rank 0 writes, per checkpoint of the run,
whether the full parameter vectors of both ranks are identical, plus the max difference. Between phases (separate
`train()` calls) it hard-resets with `prorl_trl.reset`: first a same-shape reset *without* broadcast (the replicas
must differ: that is what makes the test able to fail), then the broadcast, then a rank/target change.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from prorl_trl.reset import broadcast_adapter, lora_parameters, merge_lora_in_place, reinit_adapter  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402


def token_hash_reward(completion_ids, **kwargs):
    """An arbitrary but deterministic score that varies inside every group, so each step has a gradient."""
    return [(sum(ids) % 13) / 13 for ids in completion_ids]


def parameters_vector(model):
    return torch.cat([p.detach().double().flatten() for _, p in sorted(model.named_parameters())])


def compare_ranks(model):
    vector = parameters_vector(model)
    gathered = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, vector)
    return {"equal": all(torch.equal(gathered[0], g) for g in gathered), "max_diff": float((gathered[0] - gathered[1]).abs().max())}


def start_phase(trainer, max_steps, new_optimizer):
    """What a phase boundary does between train() calls (see notes §2): fresh step buffers, optimizer, schedule."""
    trainer.args.max_steps = max_steps
    trainer._buffered_inputs = None
    trainer._step = 0
    trainer.lr_scheduler = None
    if new_optimizer:
        trainer.optimizer = None
        trainer.model_wrapped = trainer.model  # new Parameters: let the next train() build a new DDP wrapper


def main(out_path):
    torch.set_num_threads(1)
    model, tokenizer = build_tiny(seed=0)
    prompts = [f"Question {i}: add {i} and {i + 3}." for i in range(32)]
    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "ddp_run"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        ddp_find_unused_parameters=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=token_hash_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], task_type="CAUSAL_LM"),
    )
    results = {}
    trainer.train()
    results["after_phase_1"] = compare_ranks(trainer.model)

    merge_lora_in_place(trainer.model)
    reinit_adapter(trainer.model)  # unseeded: each rank's RNG differs (TRL seeds per process)
    results["reset_without_broadcast"] = compare_ranks(trainer.model)
    broadcast_adapter(trainer.model)
    results["reset_with_broadcast"] = compare_ranks(trainer.model)

    start_phase(trainer, max_steps=2, new_optimizer=True)
    trainer.train()
    results["after_phase_2"] = compare_ranks(trainer.model)

    merge_lora_in_place(trainer.model)
    results["shape_changed"] = reinit_adapter(trainer.model, r=8, target_modules=["q_proj", "v_proj", "up_proj"])
    broadcast_adapter(trainer.model)
    results["reshape_with_broadcast"] = compare_ranks(trainer.model)
    start_phase(trainer, max_steps=2, new_optimizer=True)
    trainer.train()
    results["after_phase_3"] = compare_ranks(trainer.model)
    results["phase_3_trained_new_adapter"] = all(
        p.abs().sum().item() > 0 for name, p in lora_parameters(trainer.model) if "lora_B" in name
    )
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
