"""Worker for tests/test_ddp_stop.py: a stop requested on one rank only stops both ranks at the same step, with one
checkpoint. Run as `torchrun --nproc_per_node 2 tests/_ddp_stop_worker.py OUT_DIR`; each rank writes
`OUT_DIR/rank<r>.json` (where it stopped, why, and which checkpoint `RunInterrupted` named)."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from prorl_trl.config import ProRLConfig  # noqa: E402
from prorl_trl.recipe.run import leave_process_group  # noqa: E402
from prorl_trl.tiny import build_tiny  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402
from prorl_trl.trainer.interrupt import RunInterrupted  # noqa: E402


def token_hash_reward(completion_ids, **kwargs):
    return [(sum(ids) % 13) / 13 for ids in completion_ids]


class StopOnRankOne(TrainerCallback):
    """Rank 1 alone asks to stop while step 2 of phase 0 runs (as if only its process got the signal)."""

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer.accelerator.process_index == 1 and self.trainer.prorl_global_step == 1:
            self.trainer.request_stop("SIGTERM")


def main(out: Path) -> None:
    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], bf16=False, use_cpu=True,
        gradient_checkpointing=False, disable_tqdm=True, seed=0, phases=[{"max_steps": 3}, {"max_steps": 2}],
    )  # fmt: skip
    trainer = ProRLTrainer(
        model=model, reward_funcs=token_hash_reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [f"Q {i}: {i}+{i + 3}=" for i in range(32)]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        callbacks=[StopOnRankOne()],
    )  # fmt: skip
    result = {"interrupted": False}
    try:
        trainer.train()
    except RunInterrupted as stop:
        result = {"interrupted": True, "reason": stop.reason, "global_step": stop.global_step,
                  "checkpoint": str(stop.checkpoint)}  # fmt: skip
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    from _worker_exit import exit_without_finalization

    exit_without_finalization()
