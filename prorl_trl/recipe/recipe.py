"""`Recipe`: a validated recipe, and how it builds the objects a run needs (`ProRLConfig`, `LoraConfig`, rewards).

Sections: `model`, `peft`, `data`, `rewards`, `training` (any `ProRLConfig` field), `phases` (list of
`PhaseConfig`), `validation`, `logging`, `distill`. Only `prorl_trl.recipe.checks` builds one, after every check passed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..data.spec import DataSection
from .schema import ModelSection, PeftSection, RewardSpec, ValidationSection

# Switches whose validity depends on the machine (TrainingArguments refuses bf16 on a CPU-only box); a dry run
# checks their type only.
DRY_RUN_SKIPPED = ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval", "use_liger_kernel")


def passed(path: str, broken: frozenset[str]) -> bool:
    """Whether the key path `path` passed its checks: no problem at it, under it, or at a key that holds it."""
    return not any(path == bad or path.startswith(bad + ".") or bad.startswith(path + ".") for bad in broken)


@dataclass
class Recipe:
    """A validated recipe. Building the heavy objects (`training_args`, `reward_functions`) is cheap and repeatable."""

    file: str
    raw: dict[str, Any]
    model: ModelSection
    peft: PeftSection | None
    data: DataSection
    rewards: list[RewardSpec]
    training: dict[str, Any]
    phases: list[dict[str, Any]] | None
    validation: ValidationSection | None
    description: str | None = None
    distill: dict[str, Any] | None = None  # run before the phases (prorl_trl.distill)
    warnings: list[str] = dataclasses.field(default_factory=list)
    resolved_phases: list[Any] | None = None  # filled by validation (`config.resolve_phases`)
    # Key paths with problems: empty for a recipe `load_recipe` returns. A recipe with problems is built only for
    # `validate`'s one pass (`checks.readable_parts`): its broken sections are None, its `training` holds the keys
    # that passed their checks, and the preflight skips what depends on the rest (`skipped` says what and why).
    broken: frozenset[str] = frozenset()
    skipped: list[str] = dataclasses.field(default_factory=list)

    def readable(self, path: str) -> bool:
        """Whether the value at `path` (and everything it holds or sits in) passed its checks."""
        return passed(path, self.broken)

    @property
    def output_dir(self) -> str:
        """The run folder, with `~` expanded exactly as `TrainingArguments` expands it (`os.path.expanduser`; HF leaves
        environment variables as they are), so the used-folder guard, `--resume` and `--overwrite` look at the folder
        training writes to."""
        return os.path.expanduser(str(self.training.get("output_dir") or Path("runs") / Path(self.file).stem))

    def config_kwargs(self, dry: bool = False) -> dict[str, Any]:
        kwargs = dict(self.training)
        if dry:  # hardware switches were type-checked; TrainingArguments would test them against this machine
            kwargs.update({key: False for key in DRY_RUN_SKIPPED if key in kwargs or key in ("bf16", "fp16")})
        elif "bf16" not in kwargs and not kwargs.get("fp16"):
            import torch

            # TRL turns bf16 on by default, which TrainingArguments refuses on a machine without a GPU.
            on_cpu = kwargs.get("use_cpu") or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
            kwargs["bf16"] = bool(torch.cuda.is_available() and not on_cpu)
        kwargs["output_dir"] = self.output_dir
        kwargs["trust_remote_code"] = self.model.trust_remote_code
        kwargs["reward_weights"] = [spec.weight for spec in self.rewards]
        init = {"dtype": self.model.dtype, "attn_implementation": self.model.attn_implementation}
        init["revision"] = self.model.revision
        kwargs["model_init_kwargs"] = {k: v for k, v in init.items() if v is not None}
        if self.phases is not None:
            kwargs["phases"] = [dict(p) for p in self.phases]
        return kwargs

    def training_args(self, dry: bool = False, world_size: int = 1):
        """The `ProRLConfig`. `dry=True` leaves out hardware-dependent switches (bf16 on a CPU-only box).

        `world_size` (dry runs): the processes the run will have. TRL derives the default generation batch from the
        processes it sees (`per_device_train_batch_size x processes x steps`), so a one-process check of a 7-process
        recipe would judge a batch the run never has; the run's own batch is passed explicitly instead."""
        from ..config import ProRLConfig

        kwargs = self.config_kwargs(dry=dry)
        if dry and world_size > 1 and kwargs.get("generation_batch_size") is None:
            if kwargs.get("steps_per_generation") is None:
                defaults = {f.name: f.default for f in dataclasses.fields(ProRLConfig)}
                per_device = kwargs.get("per_device_train_batch_size", defaults["per_device_train_batch_size"])
                steps = kwargs.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
                kwargs["generation_batch_size"] = per_device * world_size * steps
        return ProRLConfig(**kwargs)

    def peft_config(self):
        if self.peft is None or not self.peft.enabled:
            return None
        from peft import LoraConfig

        fields = {f.name: getattr(self.peft, f.name) for f in dataclasses.fields(self.peft) if f.name != "enabled"}
        return LoraConfig(task_type="CAUSAL_LM", **fields)

    def quantization_config(self):
        if self.model.quantization is None:
            return None
        from transformers import BitsAndBytesConfig

        if self.model.quantization == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        dtype = self.model.dtype if self.model.dtype not in ("auto", None) else "bfloat16"
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.model.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=self.model.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=dtype,
        )

    def load_tokenizer(self, local_files_only: bool = False) -> Any:
        """The run's tokenizer, left-padded as GRPO generation needs (`train`, and `validate`'s prompt-length check,
        which reads only local folders and the hub cache: `local_files_only`)."""
        from transformers import AutoTokenizer

        model = self.model
        return AutoTokenizer.from_pretrained(
            model.tokenizer_name_or_path or model.name_or_path,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            padding_side="left",
            truncation_side="left",
            local_files_only=local_files_only,
        )

    def reward_functions(self) -> list[Any]:
        import rewards

        return [rewards.get_reward(spec.name, **spec.params) for spec in self.rewards]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False, allow_unicode=True)
