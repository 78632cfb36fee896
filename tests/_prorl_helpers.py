"""Shared pieces of the ProRLTrainer tests: tiny-run settings, a dataset, a recording reward, log-prob checks."""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig

from prorl_trl.config import ProRLConfig
from prorl_trl.tiny import build_tiny

# The CPU settings that keep one optimizer step of the tiny model well under a second.
TINY_ARGS = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    max_completion_length=8,
    per_device_train_batch_size=4,
    num_generations=4,
    logging_steps=1,
    save_strategy="no",
    learning_rate=1e-2,
    disable_tqdm=True,
)


def tiny_args(tmp_path, **overrides: Any) -> ProRLConfig:
    return ProRLConfig(output_dir=str(tmp_path / "run"), **{**TINY_ARGS, **overrides})


def lora(r: int = 4, targets=("q_proj", "v_proj")) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), task_type="CAUSAL_LM")


def tiny_model(eos_bias: float = 3.0):
    """Tiny model + tokenizer whose head favours EOS a little, so completion lengths vary below the cap."""
    model, tokenizer = build_tiny(seed=0)
    bias = torch.zeros(model.lm_head.out_features)
    bias[tokenizer.eos_token_id] = eos_bias
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model, tokenizer


def prompts_dataset(n: int = 32, **columns: list) -> Dataset:
    return Dataset.from_dict({"prompt": [f"Q{i}: {i}+{i}=" for i in range(n)], **columns})


def group_sizes(prompts: list) -> list[int]:
    """Lengths of the runs of identical consecutive prompts (TRL lays a group out contiguously)."""
    sizes = []
    for i, prompt in enumerate(prompts):
        if i and prompt == prompts[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def terminated(ids: list[int], eos_id: int) -> bool:
    return len(ids) > 0 and ids[-1] == eos_id


@torch.no_grad()
def loss_vs_manual_logps(trainer, temperature: float) -> float:
    """Max |fused log-probs (what the loss uses) - log_softmax(logits / temperature)| on a fixed sequence."""
    model = trainer.model
    ids = torch.arange(3, 15).unsqueeze(0)
    mask = torch.ones_like(ids)
    keep = 6
    fused, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1 : -1].float()
    manual = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, -keep:].unsqueeze(-1)).squeeze(-1)
    return (fused - manual).abs().max().item()


class Recorder:
    """Reward function that records, per call, what generation produced and what the trainer had in force.

    Returns 1.0 for completions that end with EOS, else 0.0 (a "correctness" with variance inside groups).
    """

    __name__ = "recorder"

    def __init__(self):
        self.trainer = None
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompts, completion_ids, **kwargs):
        trainer = self.trainer
        record = {
            "lengths": [len(ids) for ids in completion_ids],
            "group_sizes": group_sizes(prompts),
            "prompts": sorted(set(map(str, prompts))),
            "phase": trainer.current_phase.index if trainer else None,
        }
        if trainer is not None:
            config = trainer.generation_config
            record.update(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens)
            peft = trainer.model.peft_config.get("default") if hasattr(trainer.model, "peft_config") else None
            if peft is not None:
                record.update(lora_r=peft.r, lora_targets=sorted(peft.target_modules))
            record["logp_error"] = loss_vs_manual_logps(trainer, config.temperature)
        self.calls.append(record)
        eos = trainer.processing_class.eos_token_id if trainer else -1
        return [1.0 if terminated(ids, eos) else 0.0 for ids in completion_ids]
