"""Worker for tests/test_ddp.py: a 3-phase ProRL LoRA run under 2-process DDP (gloo, CPU) with hard resets.

Run as `torchrun --nproc_per_node 2 tests/_ddp_worker.py OUT.json [--rollout-engine]` (the second: generation through
each rank's `RolloutEngine`, eager on CPU). Resets: at the start of phase 1 (rank 4 -> 8:
new Parameters, new optimizer and DDP wrapper), inside phase 1 (`HardResetCallback`, same shape: optimizer state
cleared in the loop) and at the start of phase 2 (same shape). After every reset and at the end, rank 0 records
whether the full parameter vectors of both ranks are identical. Finally an unseeded re-init *without* broadcast is
recorded: the replicas must differ there, which shows the comparison can fail.
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
from transformers import TrainerCallback  # noqa: E402

from prorl_trl.config import ProRLConfig  # noqa: E402
from prorl_trl.recipe.run import leave_process_group  # noqa: E402
from prorl_trl.reset import frozen_state_dict, lora_parameters, merge_lora_in_place, reinit_adapter  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402
from prorl_trl.trainer.callbacks import HardResetCallback  # noqa: E402


def token_hash_reward(completion_ids, **kwargs):
    """An arbitrary but deterministic score that varies inside every group, so each step has a gradient."""
    return [(sum(ids) % 13) / 13 for ids in completion_ids]


def compare_ranks(model):
    """Every parameter and the frozen LoRA factors of earlier resets (the whole policy), rank 0 against the rest."""
    tensors = [p for _, p in sorted(model.named_parameters())] + list(frozen_state_dict(model).values())
    vector = torch.cat([t.detach().double().flatten().to(next(model.parameters()).device) for t in tensors])
    gathered = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, vector)
    return {"equal": all(torch.equal(gathered[0], g) for g in gathered), "max_diff": float((gathered[0] - gathered[1]).abs().max())}


class RankComparison(TrainerCallback):
    """After each reset (phase start, or in-loop after `HardResetCallback`) and at the end of each phase."""

    def __init__(self):
        self.trainer, self.records, self.seen_resets = None, [], 0

    def _record(self, label):
        trainer = self.trainer
        self.records.append(dict(label=label, resets=trainer.prorl_resets, **compare_ranks(trainer.model)))
        self.seen_resets = trainer.prorl_resets

    def on_train_begin(self, args, state, control, **kwargs):
        self._record(f"start of phase {self.trainer.current_phase.index}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.prorl_resets != self.seen_resets:
            self._record(f"in-loop reset at global step {self.trainer.prorl_global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._record(f"end of phase {self.trainer.current_phase.index}")


def main(out_path, rollout_engine=False):
    torch.set_num_threads(1)
    model, tokenizer = build_tiny(seed=0)
    comparison = RankComparison()
    args = ProRLConfig(
        output_dir=str(Path(out_path).parent / "ddp_run"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        save_merged_on_reset=False,
        phases=[{"max_steps": 2}, {"max_steps": 4, "lora_r": 8}, {"max_steps": 2}],
    )
    trainer = ProRLTrainer(
        model=model,
        reward_funcs=token_hash_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(32)]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], task_type="CAUSAL_LM"),
        callbacks=[HardResetCallback(every_steps=4), comparison],
    )
    comparison.trainer = trainer
    if rollout_engine:  # each rank its own engine (eager on CPU: no CUDA graphs), reading the live DDP replica
        from prorl_trl.rollout.trl_generation import attach_rollout_engine

        trainer.rollout_engine = attach_rollout_engine(trainer, allow_cpu=True)
    trainer.train()
    ddp = trainer.model_wrapped  # re-wrapped after the shape change: built after the first frozen parts existed
    frozen = [buffer for name, buffer in trainer.model.named_buffers() if "prorl_frozen" in name]
    results = {
        "frozen_buffers": len(frozen),
        "ddp_broadcasts_no_frozen_buffer": not any(b is f for b in ddp.modules_buffers for f in frozen),
        "ddp_knew_frozen_buffers": any("prorl_frozen" in name for name in ddp.parameters_to_ignore),
        "records": comparison.records,
        "resets": trainer.prorl_resets,
        "final_rank": trainer.model.peft_config["default"].r,
        "lora_b_trained": all(p.abs().sum().item() > 0 for n, p in lora_parameters(trainer.model) if "lora_B" in n),
    }
    if rollout_engine:
        generations = torch.tensor([trainer.rollout_engine.stats.generations])
        per_rank = [torch.zeros_like(generations) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, generations)
        results["engine_generations_per_rank"] = [int(g) for g in per_rank]
    merge_lora_in_place(trainer.model)
    reinit_adapter(trainer.model)  # unseeded and not broadcast: each rank's RNG differs (TRL seeds per process)
    results["reset_without_broadcast"] = compare_ranks(trainer.model)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], rollout_engine="--rollout-engine" in sys.argv[2:])
    from _worker_exit import exit_without_finalization

    exit_without_finalization()
