"""Distillation by rejection sampling: sample a teacher, keep one verified completion per problem, SFT the student.

Why: small models often collapse under direct RL (on Knights-and-Knaves a 1.5B instruct model learned to write an
empty thinking block and guess). Fine-tuning them first on a stronger RL-trained teacher's *verified* solutions gives
RL a starting policy that already writes the format and is sometimes right, so the rewards carry signal. Only
completions the task's reward marks correct are kept, at most one per problem, so the student imitates successes and
the distilled set stays as diverse as the problems.

Steps: `rejection_sample` (`prorl_trl.rejection_sampling`: teacher samples graded by the reward registry, one correct
sample kept per problem) -> `distilled.jsonl` -> `train_student` (TRL `SFTTrainer`, prompt-completion format, loss
on the completion only; LoRA merged before saving). `distill` chains them; `run_distill` is the `prorl-trl distill`
command; `run_distill_section` runs a recipe's `distill:` section before its ProRL phases.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from .distill_run import DISTILLED_FILE, SUMMARY_FILE, check_names, check_teacher, close_match, distill, load_problems

__all__ = [
    "DISTILLED_FILE", "SUMMARY_FILE", "DistillConfig", "add_distill_arguments", "check_distill_section", "distill",
    "distill_config_from_section", "load_problems", "run_distill", "run_distill_section",
]  # fmt: skip


@dataclass
class DistillConfig:
    r"""
    Settings of one distillation run (`prorl-trl distill` flags, or a recipe's `distill:` section).

    Parameters:
        > Models, data and grading

        teacher (`str`): Path (or hub id) of the teacher, usually an RL-trained checkpoint.
        student (`str`): Path (or hub id) of the student to fine-tune. In a recipe it is the recipe's model.
        dataset (`str`): Data builder name (`gsm8k`, `math500`, `kk`, `jsonl`, `synthetic_arithmetic`, ...).
        dataset_kwargs (`dict`): The rest of a recipe `data:` section for that builder (`source`, `split`,
            `template`, `prompt_format`, `options`, `columns`, `max_prompt_tokens`, ...).
        reward (`str`): Reward registry name used to decide which samples are correct.
        reward_kwargs (`dict`): Parameters of the reward (`rewards.get_reward(name, **reward_kwargs)`).
        correct_threshold (`float`, *optional*): A sample is correct when its reward is >= this. None: the
            registry's test (`rewards.is_correct`; for `kk_logic` the full score), else reward > 0.
        max_problems (`int`, *optional*): Use only the first this many problems.

        > Teacher sampling

        samples, temperature, top_p, max_completion_length, sampling_batch_size, use_vllm, seed.

        > Student fine-tuning (TRL `SFTConfig` fields of the same name; anything else goes in `sft_kwargs`)

        num_train_epochs, learning_rate, per_device_train_batch_size, gradient_accumulation_steps, max_length,
        bf16, use_cpu, report_to, use_peft, lora_r, lora_alpha, lora_target_modules, sft_kwargs.

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
        default_factory=dict, metadata={"help": "Other trl.SFTConfig fields (JSON/YAML mapping), e.g. warmup_ratio."}
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
        if self.max_problems is not None and self.max_problems < 1:
            problems.append(f"`max_problems` must be >= 1, got {self.max_problems}")
        if self.num_train_epochs <= 0 or self.learning_rate <= 0:
            problems.append("`num_train_epochs` and `learning_rate` must be > 0")
        clash = sorted(set(self.sft_kwargs) & {f for f in self.__dataclass_fields__ if f != "sft_kwargs"})
        if clash:
            problems.append(f"`sft_kwargs` repeats {clash}: set them as distill options instead")
        if problems:
            raise ValueError("Invalid distillation settings: " + "; ".join(problems) + ".")


# ------------------------------------------------------------------------------------------- CLI and recipes


def _mapping(text: str) -> dict[str, Any]:
    import yaml

    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON/YAML mapping such as \'{{"split": "train"}}\', got {text!r}'
        )
    return value


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "y"):
        return True
    if lowered in ("false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optional(kind: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_distill_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `DistillConfig` field (`--out` is short for `--output_dir`); help comes from the fields."""
    hints = get_type_hints(DistillConfig)
    for spec in fields(DistillConfig):
        hint, required = str(hints[spec.name]), spec.default is MISSING and spec.default_factory is MISSING
        names = ["--out", "--output_dir"] if spec.name == "output_dir" else [f"--{spec.name}"]
        kwargs: dict[str, Any] = {"dest": spec.name, "help": spec.metadata["help"], "required": required}
        if not required:
            kwargs["default"] = spec.default_factory() if callable(spec.default_factory) else spec.default
        if "dict" in hint:
            kwargs["type"] = _mapping
        elif "bool" in hint:
            kwargs.update(type=_bool, metavar="{true,false}")
        elif "list" in hint:
            kwargs["nargs"] = "+"
        elif "int" in hint:
            kwargs["type"] = _optional(int) if "None" in hint else int
        elif "float" in hint:
            kwargs["type"] = _optional(float) if "None" in hint else float
        parser.add_argument(*names, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    values = {spec.name: getattr(args, spec.name) for spec in fields(DistillConfig) if hasattr(args, spec.name)}
    modules = values.get("lora_target_modules")
    if isinstance(modules, list) and len(modules) == 1 and modules[0] == "all-linear":
        values["lora_target_modules"] = "all-linear"
    return DistillConfig(**values)


def run_distill(args: argparse.Namespace) -> int:
    """`prorl-trl distill`: exit 0 on success, 2 on bad settings (reported before any model is loaded)."""
    try:
        config = config_from_args(args)
        if config.student is None:
            raise ValueError("--student is required.")
        check_names(config)
        check_teacher(config.teacher)
    except (ValueError, FileNotFoundError) as error:
        print(f"prorl-trl distill: {error}", file=sys.stderr)
        return 2
    summary = distill(config)
    from accelerate import PartialState

    if PartialState().is_main_process:
        shown = {key: value for key, value in summary.items() if key not in ("sampling", "settings")}
        print(json.dumps(shown, indent=2))
    return 0


# Keys a recipe's `distill:` section may not set: the recipe supplies them.
_SECTION_OWNED = ("student", "output_dir")


def distill_config_from_section(
    section: dict[str, Any],
    model_path: str | None = None,
    out_dir: str | Path | None = None,
    data: Any = None,
    where: str = "distill",
) -> DistillConfig:
    """A recipe's `distill:` section as a `DistillConfig`; raises `ValueError` naming the bad key (no I/O).

    The student is the recipe's model (`model_path`) and the output goes to `out_dir` (placeholders when None, for
    early validation). `dataset` may be a builder name or a mapping `{builder|name: ..., <data-section keys>}`;
    without one, the recipe's own `data:` section (`data`, a `DataSection` or mapping) is used, so the student is
    distilled on the problems the RL phases train on.
    """
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected a mapping of distillation settings, got {type(section).__name__}.")
    allowed = [spec.name for spec in fields(DistillConfig) if spec.name not in _SECTION_OWNED]
    for key in section:
        if key not in allowed:
            owned = " (the recipe's model and output folder are used)" if key in _SECTION_OWNED else ""
            raise ValueError(
                f"{where}.{key}: unknown key{owned}{close_match(key, allowed)}; allowed: {', '.join(allowed)}."
            )
    values = dict(section)
    dataset = values.get("dataset", data)
    if dataset is not None and not isinstance(dataset, (str, dict)):  # a DataSection
        dataset = {spec.name: getattr(dataset, spec.name) for spec in fields(dataset)}
    if isinstance(dataset, dict):
        dataset = dict(dataset)
        name = dataset.pop("builder", None) or dataset.pop("name", None)
        if name is None:
            raise ValueError(f"{where}.dataset: a mapping needs a `builder` key (a data builder name, e.g. kk).")
        defaults = _data_defaults()
        kwargs = {key: value for key, value in dataset.items() if defaults.get(key, MISSING) != value}
        values["dataset"], values["dataset_kwargs"] = name, {**kwargs, **values.get("dataset_kwargs", {})}
    for key in ("teacher", "dataset", "reward"):
        if key not in values:
            raise ValueError(
                f"{where}.{key}: required (e.g. teacher: path/to/rl_checkpoint, dataset: kk, reward: kk_logic)."
            )
    try:
        config = DistillConfig(**values, student=model_path or "<recipe model>", output_dir=str(out_dir or "<out>"))
        check_names(config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return config


def _data_defaults() -> dict[str, Any]:
    from .recipe_schema import DataSection

    return {spec.name: spec.default for spec in fields(DataSection) if spec.default is not MISSING} | {
        spec.name: spec.default_factory() for spec in fields(DataSection) if spec.default_factory is not MISSING
    }


def check_distill_section(section: Any, data: Any = None, where: str = "distill") -> list[tuple[str, str]]:
    """Problems of a recipe's `distill:` section as `(key path, message)` pairs; empty when valid. No I/O."""
    try:
        distill_config_from_section(section, data=data, where=where)
    except ValueError as error:
        path, _, message = str(error).partition(": ")
        return [(path, message)]
    return []


def run_distill_section(section: dict[str, Any], model_path: str, out_dir: str | Path, data: Any = None) -> str:
    """Run a recipe's `distill:` section on the recipe's model; returns the distilled student's path.

    The recipe's ProRL phases then start from the returned path (a plain HF model folder). A finished distillation
    in `out_dir` with the same settings is not redone, so a resumed recipe goes straight to its phases.
    """
    return distill(distill_config_from_section(section, model_path, out_dir, data=data))["student_path"]
