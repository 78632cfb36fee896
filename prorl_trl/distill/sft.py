"""The student step of distillation: TRL's `SFTTrainer` on the distilled prompt-completion rows, saved in HF format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..attention import install_cudnn_attention_guard
from ..console import announce
from ..model_card import write_model_card
from ..trainer.progress import use_run_progress
from .config import DistillConfig

SFT_DIR = "sft"
MODEL_DIR = "model"


def _bf16(config: DistillConfig) -> bool:
    if config.bf16 is not None:
        return config.bf16
    import torch

    return not config.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _tokenizer(config: DistillConfig) -> Any:
    """The tokenizer `tokenizer_name_or_path` names, loaded as a recipe loads it (the model's `revision`); None
    without one. It is saved with the student, so what trains from the student next reads the same tokenizer."""
    if not config.tokenizer_name_or_path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        config.tokenizer_name_or_path,
        revision=config.model_init_kwargs.get("revision"),
        trust_remote_code=config.trust_remote_code,
    )


def train_student(config: DistillConfig, rows: Sequence[dict[str, Any]], student: str | Any) -> tuple[Path, dict]:
    """Fine-tune `student` (path or model) on the distilled rows with TRL's `SFTTrainer`; save it in HF format.

    Prompt-completion format with `completion_only_loss=True`: the student learns the answers, not the questions.
    With `use_peft` the adapter is merged before saving, so the result loads as a plain model (and can be the base
    of a later ProRL run). Returns the saved model folder and the completion loss on the distilled set before and
    after training.
    """
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if not rows:
        raise ValueError(
            "No distilled rows to train on: the teacher got no problem right. Raise `samples` or "
            "`temperature`, check the reward, or use a stronger teacher."
        )
    output_dir = Path(config.output_dir)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "completion": row["completion"]} for row in rows])
    settings = {
        "output_dir": str(output_dir / SFT_DIR),
        "num_train_epochs": config.num_train_epochs,
        "learning_rate": config.learning_rate,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "per_device_eval_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "max_length": config.max_length,
        "bf16": _bf16(config),
        "use_cpu": config.use_cpu,
        "report_to": config.report_to,
        "seed": config.seed,
        "completion_only_loss": True,
        "save_strategy": "no",
        "logging_steps": 10,
        "model_init_kwargs": config.model_init_kwargs or None,  # dtype, attn_implementation, revision
        "trust_remote_code": config.trust_remote_code,
        **config.sft_kwargs,
    }
    peft_config = None
    if config.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            target_modules=config.lora_target_modules,
            task_type="CAUSAL_LM",
        )
    trainer = SFTTrainer(
        model=student,
        args=SFTConfig(**settings),
        train_dataset=dataset,
        eval_dataset=dataset,
        processing_class=_tokenizer(config),  # None: TRL loads the student's own, at its revision
        peft_config=peft_config,
    )
    use_run_progress(trainer)  # a bar with rate and ETA and a short line per log, not HF's dict per log
    import torch

    guard = install_cudnn_attention_guard(trainer.accelerator.unwrap_model(trainer.model), config.cudnn_attention_guard,
                                          torch.float16 if trainer.args.fp16 else None)  # fmt: skip
    if guard.active and trainer.accelerator.is_main_process:
        announce(guard.message)
    if config.use_peft and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise ValueError(
            "use_peft with DeepSpeed/FSDP cannot merge the adapter into sharded weights here; "
            "fine-tune fully (use_peft=False) or run distillation without DeepSpeed/FSDP."
        )
    losses = {"loss_before": trainer.evaluate()["eval_loss"]}
    trainer.train()
    losses["loss_after"] = trainer.evaluate()["eval_loss"]
    model_dir = output_dir / MODEL_DIR
    if config.use_peft:
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        if trainer.accelerator.is_main_process:
            merged.save_pretrained(model_dir)
            trainer.processing_class.save_pretrained(model_dir)
        del merged
    else:
        trainer.save_model(str(model_dir))
    if trainer.accelerator.is_main_process:
        write_model_card(
            model_dir,
            str(student) if isinstance(student, (str, Path)) else config.student or "the student model",
            f"Distilled with prorl-trl (rejection sampling, then supervised fine-tuning): trained on {len(rows)} "
            f"completions of the teacher `{config.teacher}` that the reward `{config.reward}` verified.",
            [
                "## Distillation",
                "",
                f"- teacher: `{config.teacher}`, {config.samples} samples per problem at temperature "
                f"{config.temperature}, top_p {config.top_p}",
                f"- data: builder `{config.dataset}` {config.dataset_kwargs or ''}".rstrip(),
                f"- reward: `{config.reward}` {config.reward_kwargs or ''}".rstrip(),
                f"- fine-tuning: {config.num_train_epochs:g} epochs, learning rate {config.learning_rate:g}, "
                + ("LoRA merged" if config.use_peft else "full"),
                f"- completion loss on the distilled set: {losses['loss_before']:.4f} before, "
                f"{losses['loss_after']:.4f} after",
            ],
        )
    trainer.accelerator.wait_for_everyone()
    return model_dir, losses
