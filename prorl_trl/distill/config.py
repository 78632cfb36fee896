"""`DistillConfig`: the settings of one distillation run (`prorl-trl distill` flags or a recipe's `distill:`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from ..attention import CUDNN_GUARD_MODES


@dataclass
class DistillConfig:
    r"""
    Settings of one distillation run (`prorl-trl distill` flags, or a recipe's `distill:` section).

    Parameters:
        > Models, data and grading

        teacher (`str`): Path (or hub id) of the teacher, usually an RL-trained checkpoint.
        student (`str`): Path (or hub id) of the student to fine-tune. In a recipe it is the recipe's model.
        model_init_kwargs (`dict`): Loading options of the student (TRL `SFTConfig.model_init_kwargs`: `dtype`,
            `attn_implementation`, `revision`). In a recipe: its `model:` section's.
        tokenizer_name_or_path (`str`, *optional*): The student's tokenizer (loaded with the student's
            `revision`); None: the student's own. In a recipe: `model.tokenizer_name_or_path`.
        trust_remote_code (`bool`): Run the teacher's and the student's repo code when loading them. In a recipe:
            `model.trust_remote_code`.
        dataset (`str`): Data builder name (`gsm8k`, `math500`, `kk`, `jsonl`, `synthetic_arithmetic`, ...).
        dataset_kwargs (`dict`): The rest of a recipe `data:` section for that builder (`source`, `split`,
            `template`, `prompt_format`, `options`, `columns`, `max_prompt_tokens`, ...).
        reward (`str`): Reward registry name used to decide which samples are correct.
        reward_kwargs (`dict`): Parameters of the reward (`rewards.get_reward(name, **reward_kwargs)`).
        correct_threshold (`float`, *optional*): A sample is correct when its reward is >= this. None: the
            registry's test (`rewards.is_correct`; for `kk_logic` the full score), else reward > 0.
        max_problems (`int`, *optional*): Use only the first this many problems.
        min_kept (`int`): Refuse to fine-tune the student when fewer problems than this keep a verified completion
            (the distilled set stays in `output_dir` to inspect). Below 10% kept, a warning is printed either way.

        > Teacher sampling

        samples, temperature, top_p, max_completion_length, sampling_batch_size, use_vllm, seed.

        > Student fine-tuning (TRL `SFTConfig` fields of the same name; anything else goes in `sft_kwargs`)

        num_train_epochs, learning_rate, per_device_train_batch_size, gradient_accumulation_steps, max_length,
        bf16, use_cpu, report_to, use_peft, lora_r, lora_alpha, lora_target_modules, sft_kwargs.
        cudnn_attention_guard (`str`, defaults to `"auto"`): As `ProRLConfig.cudnn_attention_guard`: keep cuDNN's
            SDPA backward from making the student's gradients NaN on H100/H200.

        > Output

        output_dir (`str`): Where `distilled.jsonl` and `distill_summary.json` (a re-run with the same sampling
            settings reuses them), the SFT run (`sft/`) and the final student in Hugging Face format (`model/`) go.
    """

    teacher: str = field(metadata={"help": "Path (or hub id) of the teacher model, usually an RL-trained checkpoint."})
    dataset: str = field(
        metadata={"help": "Data builder name (gsm8k, math500, kk, jsonl, synthetic_arithmetic, ...)."}
    )
    reward: str = field(metadata={"help": "Reward registry name that decides which teacher samples are correct."})
    output_dir: str = field(metadata={"help": "Output folder: distilled.jsonl, distill_summary.json, sft/, model/."})
    student: str | None = field(
        default=None, metadata={"help": "Path (or hub id) of the student model (a recipe passes its own model)."}
    )
    model_init_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Student loading options (JSON/YAML mapping, TRL SFTConfig.model_init_kwargs): dtype, "
            "attn_implementation, revision. A recipe passes its model section's."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "The student's tokenizer (with the student's revision); None: its own."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the teacher's and student's repo code when loading them."}
    )
    dataset_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Other data-section keys (JSON/YAML mapping): source, split, template, prompt_format, options, "
            "columns, max_prompt_tokens, ..."
        },
    )
    reward_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Parameters of the reward: get_reward(name, **reward_kwargs)."}
    )
    correct_threshold: float | None = field(
        default=None,
        metadata={"help": "A sample is correct when its reward >= this. None: rewards.is_correct (else reward > 0)."},
    )
    max_problems: int | None = field(default=None, metadata={"help": "Use only the first this many problems."})
    min_kept: int = field(
        default=1,
        metadata={
            "help": "Refuse to fine-tune the student when fewer problems than this keep a verified completion "
            "(the distilled set is kept to inspect); below a tenth of the problems kept, a warning is printed anyway."
        },
    )
    samples: int = field(default=5, metadata={"help": "Teacher completions sampled per problem."})
    temperature: float = field(default=1.0, metadata={"help": "Teacher sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Teacher nucleus sampling mass, in (0, 1]."})
    max_completion_length: int = field(default=1024, metadata={"help": "Maximum new tokens per teacher sample."})
    sampling_batch_size: int = field(
        default=64, metadata={"help": "Sequences (problem x sample rows) per teacher generate call."}
    )
    use_vllm: bool = field(default=False, metadata={"help": "Sample the teacher with vLLM (GPU; must be installed)."})
    seed: int = field(default=0, metadata={"help": "Seed of teacher sampling and of student fine-tuning."})
    num_train_epochs: float = field(default=4.0, metadata={"help": "SFT epochs over the distilled set."})
    learning_rate: float = field(default=1e-5, metadata={"help": "SFT learning rate."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "SFT batch size per device."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "SFT gradient accumulation steps."})
    max_length: int | None = field(
        default=2048, metadata={"help": "SFT maximum prompt+completion tokens (longer rows are truncated)."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "Train in bf16. None: on when a bf16 GPU is used."})
    use_cpu: bool = field(default=False, metadata={"help": "Run sampling and SFT on the CPU."})
    report_to: str = field(
        default="none", metadata={"help": "SFT logging integrations (as in TRL: none, wandb, ...)."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Fine-tune a LoRA adapter (merged into the saved model)."})
    lora_r: int = field(default=64, metadata={"help": "LoRA rank (with use_peft)."})
    lora_alpha: int = field(default=128, metadata={"help": "LoRA alpha (with use_peft)."})
    lora_target_modules: list[str] | str = field(
        default="all-linear", metadata={"help": "LoRA target modules (with use_peft): a list, or 'all-linear'."}
    )
    sft_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={
            "help": "Other trl.SFTConfig fields (JSON/YAML mapping), e.g. lr_scheduler_type, warmup_steps (below 1: "
            "a ratio of the steps)."
        },
    )
    cudnn_attention_guard: str = field(
        default="auto",
        metadata={
            "help": "Keep cuDNN's SDPA backward from returning NaN gradients (H100/H200, torch >= 2.11): 'auto', "
            "'always' or 'off', as ProRLConfig.cudnn_attention_guard.",
            "choices": list(CUDNN_GUARD_MODES),
        },
    )

    def __post_init__(self):
        problems = []
        for name in ("teacher", "dataset", "reward", "output_dir"):
            if not getattr(self, name):
                problems.append(f"`{name}` is required")
        for name in ("samples", "max_completion_length", "sampling_batch_size", "per_device_train_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            problems.append(f"`temperature` must be > 0 (rejection sampling needs sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"`top_p` must be in (0, 1], got {self.top_p}")
        if self.cudnn_attention_guard not in CUDNN_GUARD_MODES:
            problems.append(
                f"`cudnn_attention_guard` must be one of {list(CUDNN_GUARD_MODES)}, got {self.cudnn_attention_guard!r}"
            )
        if self.min_kept < 0:
            problems.append(f"`min_kept` must be >= 0, got {self.min_kept}")
        if self.max_problems is not None and self.max_problems < 1:
            problems.append(f"`max_problems` must be >= 1, got {self.max_problems}")
        if self.num_train_epochs <= 0 or self.learning_rate <= 0:
            problems.append("`num_train_epochs` and `learning_rate` must be > 0")
        clash = sorted(set(self.sft_kwargs) & {f for f in self.__dataclass_fields__ if f != "sft_kwargs"})
        if clash:
            problems.append(f"`sft_kwargs` repeats {clash}: set them as distill options instead")
        problems += unknown_sft_kwargs(self.sft_kwargs)
        if problems:
            raise ValueError("Invalid distillation settings: " + "; ".join(problems) + ".")


# Keys people carry over from older transformers/TRL versions, and what this version reads instead.
_SFT_RENAMED = {
    "warmup_ratio": "transformers 5 dropped warmup_ratio; warmup_steps below 1 is read as the same ratio",
    "torch_dtype": "the student's dtype is `model_init_kwargs.dtype` (a recipe's `model.dtype`)",
}


def unknown_sft_kwargs(sft_kwargs: dict[str, Any]) -> list[str]:
    """A problem per `sft_kwargs` key that the installed `trl.SFTConfig` has no field for: a typo or a setting of
    another transformers/TRL version would otherwise pass validation and fail only after the teacher sampling."""
    from trl import SFTConfig

    known = [spec.name for spec in fields(SFTConfig) if spec.init]
    problems = []
    for key in sorted(set(sft_kwargs) - set(known)):
        match = difflib.get_close_matches(str(key), known, n=1)
        why = _SFT_RENAMED.get(key) or (f"did you mean {match[0]!r}?" if match else "see `trl.SFTConfig`")
        problems.append(f"`sft_kwargs.{key}` is not a trl.SFTConfig field ({why})")
    return problems
