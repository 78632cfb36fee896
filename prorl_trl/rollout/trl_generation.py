"""The rollout engine on trl 1.16's transformers generation path (`GRPOTrainer._generate_single_turn`).

TRL's transformers branch left-pads the prompt ids (`trl.trainer.utils.pad`, `pad_to_multiple_of`), calls
`unwrapped_model.generate(..., generation_config=trainer.generation_config)` inside `unwrap_model_for_generation`
(DDP unwrap, gradient checkpointing off, ZeRO-3 gather, `generation_kwargs` as the model's generation config) and
`torch.no_grad()`, cuts each row after its first token in `trainer.eos_token_ids`, and returns `(completion_ids,
None)`. `generate_completions` does the same with `RolloutEngine.generate` in place of `generate`; the trainer
(`ProRLTrainer._generate_single_turn`) calls it and falls back to TRL's own code when it returns None.

`engine_unavailable` says when the engine is not used at all: vLLM or continuous batching (other engines), FSDP or
DeepSpeed ZeRO-3 (parameters gathered into new storage at every generation: a graph would read stale memory), a
device other than CUDA (unless `allow_cpu`, for tests), or a model the decode loop does not support. Under DDP every
process builds its own engine and graphs. Per call, an unsupported generation setting (say `repetition_penalty`)
falls back to `generate`, with one warning per reason.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .decoder import UnsupportedModel, decoder_parts, generation_target
from .engine import RolloutEngine

logger = logging.getLogger("prorl_trl")


def engine_unavailable(trainer: Any, allow_cpu: bool = False) -> str | None:
    """Why `trainer` cannot generate with the rollout engine (None: it can)."""
    if getattr(trainer, "use_vllm", False):
        return "vLLM generates (use_vllm)"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "continuous batching generates (use_transformers_continuous_batching)"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP gathers parameters into new storage at every generation"
    if getattr(getattr(trainer, "_dist", None), "is_zero3", False):
        return "DeepSpeed ZeRO-3 gathers parameters into new storage at every generation"
    device = trainer.accelerator.device
    if device.type != "cuda" and not allow_cpu:
        return f"the model is on {device.type}, not CUDA"
    try:
        decoder_parts(trainer.accelerator.unwrap_model(trainer.model))
    except UnsupportedModel as error:
        return str(error)
    return None


def attach_rollout_engine(trainer: Any, allow_cpu: bool = False, **engine_kwargs: Any) -> RolloutEngine | None:
    """A `RolloutEngine` for `trainer` (prompt budget: `args.generation_max_prompt_length`), or None with a warning
    saying why TRL's `generate` stays in use."""
    reason = engine_unavailable(trainer, allow_cpu=allow_cpu)
    if reason is not None:
        logger.warning("rollout_engine: not used (%s); generating with TRL's transformers path.", reason)
        return None
    engine_kwargs.setdefault("prompt_budget", getattr(trainer.args, "generation_max_prompt_length", None))
    if trainer.accelerator.device.type != "cuda":
        engine_kwargs.setdefault("cuda_graphs", False)
        engine_kwargs.setdefault("compile", False)
    return RolloutEngine(**engine_kwargs)


def accelerate_autocast_dtype(trainer: Any, model: Any) -> torch.dtype | None:
    """The autocast `generate` would run under: accelerate wraps the forward of the model it prepared (mixed
    precision); `generate` calls that forward only when that model is the generation target itself (not PEFT)."""
    target = generation_target(model)
    if "_original_forward" not in vars(target):
        return None
    precision = str(getattr(trainer.accelerator, "mixed_precision", "no"))
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def left_pad(prompt_ids: list[list[int]], pad_token_id: int, pad_to_multiple_of: int | None, device) -> tuple:
    """`(input_ids, attention_mask)` left-padded exactly as TRL's transformers branch pads them."""
    from trl.trainer.utils import pad

    rows = [torch.tensor(ids) for ids in prompt_ids]
    input_ids = pad(rows, padding_value=pad_token_id, padding_side="left", pad_to_multiple_of=pad_to_multiple_of)
    mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left", pad_to_multiple_of=pad_to_multiple_of)
    return input_ids.to(device), mask.to(device)


def completion_lists(tokens: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """TRL's cut: each row up to and including its first token in `eos_token_ids` (all of it when there is none)."""
    is_eos = torch.isin(tokens, torch.tensor(eos_token_ids, device=tokens.device))
    ends = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, tokens.shape[1]).tolist()
    return [row[:end] for row, end in zip(tokens.tolist(), ends, strict=True)]


_warned: set[str] = set()


def generate_completions(trainer: Any, engine: RolloutEngine, prompt_ids: list[list[int]]) -> list[list[int]] | None:
    """Completion ids for `prompt_ids` as TRL's transformers branch returns them, or None to let TRL generate."""
    from trl.extras.profiling import profiling_context
    from trl.models import unwrap_model_for_generation

    input_ids, attention_mask = left_pad(
        prompt_ids, trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of, trainer.accelerator.device
    )
    with (
        profiling_context(trainer, "rollout_engine.generate"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
    ):
        reason = engine.unsupported_reason(model, trainer.generation_config)
        if reason is not None:
            if reason not in _warned:
                _warned.add(reason)
                logger.warning("rollout_engine: falling back to generate (%s).", reason)
            return None
        output = engine.generate(
            model, input_ids, attention_mask, trainer.generation_config,
            autocast_dtype=accelerate_autocast_dtype(trainer, model),
        )  # fmt: skip
    return completion_lists(output.tokens, trainer.eos_token_ids)
