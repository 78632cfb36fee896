"""Translate a flat GRPO config into a recipe: open-r1's `recipes/*/grpo/*.yaml` (TrlParser over its
`GRPOScriptArguments`, `GRPOConfig` and TRL's `ModelConfig`) and TRL's `trl grpo --config` files.

Every key of the source file ends up in exactly one of two places, so nothing is dropped silently:
- `Translation.mapped`: the recipe key it became (`learning_rate -> training.learning_rate`), with a note in
  `Translation.notes` where the meaning differs from the source's (`max_prompt_length` drops, not truncates);
- `Translation.unmapped`: the reason it has no place in a recipe, and what to do instead.

The key tables below are the documentation: `docs/recipes-and-cli.md` lists what maps and what does not.
`prorl-trl convert FILE` writes the recipe with the unmapped keys and notes as a comment block on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .schema import LoggingSection, ModelSection, suggest

# Source keys that move one-to-one to a recipe key (`section.key`; `data.columns.prompt` is one entry of a mapping).
MOVED_KEYS = {
    "model_name_or_path": "model.name_or_path",
    "model_revision": "model.revision",
    "attn_implementation": "model.attn_implementation",
    "trust_remote_code": "model.trust_remote_code",
    "bnb_4bit_quant_type": "model.bnb_4bit_quant_type",
    "use_bnb_nested_quant": "model.bnb_4bit_use_double_quant",
    "dataset_name": "data.source",
    "dataset_config": "data.config",
    "dataset_train_split": "data.split",
    "dataset_test_split": "data.validation_split",
    "system_prompt": "data.system_prompt",
    "dataset_prompt_column": "data.columns.prompt",
    "max_prompt_length": "data.max_prompt_tokens",
    "warmup_ratio": "training.warmup_steps",
    "hub_model_revision": "training.hub_revision",
}
LORA_KEYS = {
    "lora_r": "peft.r",
    "lora_alpha": "peft.lora_alpha",
    "lora_dropout": "peft.lora_dropout",
    "lora_target_modules": "peft.target_modules",
    "use_rslora": "peft.use_rslora",
}
# How a mapped key's meaning differs from the source's (shown in the report and the written recipe).
NOTES = {
    "max_prompt_length": "TRL 1.16's GRPOConfig has no max_prompt_length (prompts are no longer truncated); "
    "data.max_prompt_tokens drops longer prompts (after templating, count logged) instead of left-truncating them",
    "dataset_prompt_column": "open-r1 makes [system_prompt, user: <column>] messages; the recipe does the same with "
    "template `raw`, prompt_format `chat` and data.system_prompt",
    "warmup_ratio": "transformers 5 dropped warmup_ratio; warmup_steps below 1 is read as the same ratio",
    "hub_model_revision": "pushed by transformers' push_to_hub to this branch (open-r1's own callback is not used)",
    "scale_rewards": "TRL 1.16 reads true/false as 'group'/'none'; written as the string",
    "torch_dtype": "TRL 1.16 calls it dtype",
}
# Notes about a key the file leaves out, given where the translation fills it in (never when the file sets the key).
UNSET_NOTES = {
    "vllm_mode": "open-r1 runs vLLM as a server (`trl vllm-serve` on one GPU, `accelerate launch --num_processes 7` "
    "on the other seven), the default of the TRL it pinned; TRL 1.16's default is colocate, so the recipe sets "
    "training.vllm_mode: server (set colocate to share the training GPUs)",
    "lora_target_modules": "lora_target_modules not set: TRL leaves it to PEFT's per-model default (q_proj, v_proj "
    "for Qwen and Llama); the recipe's peft.target_modules default is all-linear",
}
# TRL ModelConfig's LoRA defaults, written out where a file with `use_peft: true` leaves them unset.
TRL_LORA_DEFAULTS = {"enabled": True, "r": 16, "lora_alpha": 32, "lora_dropout": 0.05}
# Keys with no place in a recipe, and why (a reason says what to do instead where there is something to do).
UNMAPPED_REASONS = {
    "chat_template": "a recipe uses the tokenizer's own chat template: save a tokenizer with this template "
    "(tokenizer.chat_template = ...; save_pretrained) and point model.tokenizer_name_or_path at it",
    "callbacks": "open-r1's callbacks (push_to_hub_revision starts its Slurm benchmark jobs) have no equivalent; "
    "the run's checkpoints and final/ model are in the output folder",
    "benchmarks": "open-r1 starts lighteval jobs after training; run `prorl-trl eval` on the final model instead",
    "overwrite_output_dir": "transformers 5 has no such argument; pass --overwrite to `prorl-trl train`",
    "vllm_device": "removed from TRL: vLLM runs colocated (training.vllm_mode: colocate) or as a `trl vllm-serve` "
    "server (training.vllm_mode: server)",
    "push_to_hub_revision": "an open-r1 callback switch; training.push_to_hub with training.hub_revision pushes to a "
    "branch",
    "overwrite_hub_revision": "an open-r1 callback switch with no equivalent",
    "wandb_entity": "set WANDB_ENTITY in the run's environment (W&B reads it)",
    "wandb_project": "set WANDB_PROJECT in the run's environment (W&B reads it)",
    "wandb_run_group": "set WANDB_RUN_GROUP in the run's environment (W&B reads it)",
    "wandb_log_unique_prompts": "open-r1's own W&B table switch; logging.log_completions logs completions",
    "dataset_mixture": "a recipe reads one source: mix the datasets into one file (datasets.concatenate_datasets) "
    "and set data.source to it",
    "datasets": "a recipe reads one source: mix the datasets into one file and set data.source to it",
    "dataset_streaming": "the data builders load the whole split (no streaming)",
    "ignore_bias_buffers": "a DDP workaround of TRL's scripts for models with boolean buffers; not used here",
    "reward_model_name_or_path": "recipe rewards are registry functions (rewards.available()); a reward model is "
    "not supported",
    "model_init_kwargs": "model loading options are model.* keys (dtype, attn_implementation, revision, "
    "trust_remote_code, quantization)",
    "lora_target_parameters": "peft targets modules only (peft.target_modules)",
    "lora_modules_to_save": "not supported: a hard reset merges and replaces the adapter, modules_to_save would "
    "not follow",
    "lora_task_type": "always CAUSAL_LM here",
    "use_dora": "not supported: hard resets merge plain LoRA factors",
    "bnb_4bit_quant_storage": "4-bit weights are stored in bitsandbytes' default dtype here",
}
# open-r1's code-execution rewards and their parameters: sandboxes (E2B, Morph, Piston) this package does not run.
CODE_REWARDS = ("code", "binary_code", "ioi_code", "cf_code", "code_format")
CODE_KEYS = (
    "code_language", "code_eval_test_batch_size", "code_eval_scoring_mode", "parallel_code_exec_per_proc",
    "e2b_router_url", "morph_router_url", "code_provider", "ioi_provider", "enforce_same_language",
)  # fmt: skip
CODE_REASON = (
    "open-r1's code rewards run completions in a sandbox (E2B, Morph, Piston); the registry has no code "
    "execution: register your own with rewards.register() and name it in `rewards:`"
)


@dataclass(frozen=True)
class RewardMap:
    """How one source reward name becomes a registry reward: `name` (None: no equivalent, `note` says why),
    fixed `params`, params read from source keys (`our param -> (source key, the source's default)`)."""

    name: str | None
    note: str
    params: dict[str, Any] = field(default_factory=dict)
    from_keys: dict[str, tuple[str, Any]] = field(default_factory=dict)


GOLD = {"answer_key": "solution"}  # open-r1's and TRL's accuracy rewards read the gold from `solution`
REWARDS = {
    # open-r1 (src/open_r1/rewards.py, get_reward_funcs); defaults are GRPOScriptArguments'.
    "accuracy": RewardMap("math_equivalence", "math-verify equivalence; gold from the `solution` column", GOLD),
    "format": RewardMap("think_answer_format", "the same <think>/<answer> pattern"),
    "tag_count": RewardMap("tag_count", "the same 0.25 per tag"),
    "reasoning_steps": RewardMap("reasoning_steps", "the same min(1, steps / 3)"),
    "cosine": RewardMap(
        "cosine_scaled",
        "length counted in tokens (open-r1 counts characters)",
        GOLD,
        {
            "max_len": ("cosine_max_len", 1000),
            "min_value_wrong": ("cosine_min_value_wrong", 0.0),
            "max_value_wrong": ("cosine_max_value_wrong", -0.5),
            "min_value_correct": ("cosine_min_value_correct", 0.5),
            "max_value_correct": ("cosine_max_value_correct", 1.0),
        },
    ),
    "repetition_penalty": RewardMap(
        "repetition_penalty",
        "token n-grams (TRL's; open-r1 counts word n-grams)",
        {},
        {"ngram_size": ("repetition_n_grams", 3), "max_penalty": ("repetition_max_penalty", -1.0)},
    ),
    "length": RewardMap(
        "kimi_length", "Kimi k1.5 length reward; an unparsable gold is skipped (open-r1 counts it correct)", GOLD
    ),
    "soft_overlong_punishment": RewardMap(
        "soft_overlong",
        "DAPO eq. 13 on completion tokens",
        {},
        {"max_completion_len": ("max_completion_len", 16384), "soft_punish_cache": ("soft_punish_cache", 4096)},
    ),
    **{name: RewardMap(None, CODE_REASON) for name in CODE_REWARDS},
    # TRL's `trl grpo` registry (trl/scripts/grpo.py)
    "accuracy_reward": RewardMap("math_equivalence", "math-verify equivalence; gold from `solution`", GOLD),
    "get_soft_overlong_punishment": RewardMap(
        "soft_overlong", "TRL's CLI fixes 1280/256", {"max_completion_len": 1280, "soft_punish_cache": 256}
    ),
    "think_format_reward": RewardMap(
        None, "TRL's <think>-only format has no registry equivalent (think_answer_format also needs <answer>)"
    ),
    "reasoning_accuracy_reward": RewardMap(
        None, "TRL's accuracy after the reasoning block has no registry equivalent (math_equivalence grades it all)"
    ),
}
SUGGESTED_KEYS = 50  # unknown keys that get a "did you mean" (the rest are listed without one)
REWARD_PARAM_KEYS = {key for spec in REWARDS.values() for key, _ in spec.from_keys.values()}
OPEN_R1_DEFAULT_REWARDS = ["accuracy", "format", "tag_count"]  # GRPOScriptArguments.reward_funcs
# Keys only open-r1 configs have: their presence means a missing `reward_funcs` is open-r1's default.
OPEN_R1_MARKERS = {"dataset_prompt_column", "system_prompt", "chat_template", "callbacks", "benchmarks",
                   "dataset_mixture", "hub_model_revision", *REWARD_PARAM_KEYS, *CODE_KEYS}  # fmt: skip
LOGGING_KEYS = tuple(f.name for f in dataclasses.fields(LoggingSection))
DTYPES = dataclasses.fields(ModelSection)[1].metadata["choices"]
DATA_ORDER = ["builder", "source", "config", "split", "validation_split", "columns", "template", "prompt_format",
              "system_prompt", "max_prompt_tokens"]  # fmt: skip
# A hub dataset is a table whatever its files: the table builder loads it with `datasets.load_dataset`.
TABLE_BUILDER = "parquet"


@dataclass
class Translation:
    """A recipe mapping and the account of every source key (see the module docstring)."""

    recipe: dict[str, Any]
    mapped: dict[str, str] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def report(self) -> str:
        """The unmapped keys and notes, one per line."""
        lines = [f"not translated: {key}: {why}" for key, why in self.unmapped.items()]
        return "\n".join(lines + [f"note: {key} -> {self.mapped[key]}: {why}" for key, why in self.notes.items()])

    def to_yaml(self, source: str) -> str:
        """The recipe as YAML, headed by where it came from and the report as comments."""
        head = [f"# Translated from {source} by `prorl-trl convert`."]
        if self.unmapped:
            head.append("# Not translated (key: reason):")
            head += [f"#   {key}: {why}" for key, why in self.unmapped.items()]
        if self.notes:
            head.append("# Translated with a difference:")
            head += [f"#   {key} -> {self.mapped[key]}: {why}" for key, why in self.notes.items()]
        body = yaml.dump(self.recipe, Dumper=_BlockTextDumper, sort_keys=False, allow_unicode=True, width=120)
        return "\n".join(head) + "\n" + body


class _BlockTextDumper(yaml.SafeDumper):
    """Multi-line text (a system prompt) as a `|` block, as a person writes it."""


_BlockTextDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text.strip("\n") else None
    ),
)


def translate_flat_config(raw: dict[str, Any], source: str = "a flat GRPO config") -> Translation:
    """The recipe for a flat TRL/open-r1 GRPO config (its keys as TrlParser reads them), with every key accounted for."""
    from ..config import ProRLConfig

    training_fields = {f.name for f in dataclasses.fields(ProRLConfig) if f.init}
    out = Translation(
        recipe={
            "description": f"Translated from {source} (flat GRPO config).",
            "model": {},
            "peft": None,
            "data": {"builder": TABLE_BUILDER, "template": "raw", "prompt_format": "chat"},
            "rewards": [],
            "training": {},
            "logging": {},
        }
    )
    use_peft = raw.get("use_peft") is True
    known = [*MOVED_KEYS, *LORA_KEYS, *UNMAPPED_REASONS, *training_fields]
    suggestions = SUGGESTED_KEYS  # difflib per unknown key is slow: a file of 100,000 made-up keys gets no answers
    for key, value in raw.items():
        if key in MOVED_KEYS:
            _put(out, key, MOVED_KEYS[key], value)
        elif key in LORA_KEYS:
            if use_peft:
                _put(out, key, LORA_KEYS[key], value)
            else:
                out.unmapped[key] = "a LoRA setting without `use_peft: true`: TRL ignores it too (full fine-tuning)"
        elif key in ("torch_dtype", "dtype"):
            if value in DTYPES:
                _put(out, key, "model.dtype", value)
            else:
                out.unmapped[key] = f"model.dtype takes {', '.join(DTYPES)}, not {value!r}"
        elif key in ("load_in_4bit", "load_in_8bit"):
            if value is True:
                _put(out, key, "model.quantization", key[len("load_in_") :])
            else:
                out.mapped[key] = "model.quantization (none)"
        elif key == "use_peft":
            out.mapped[key] = "peft" if use_peft else "peft: null (full fine-tuning)"
            if use_peft and "lora_target_modules" not in raw:
                out.notes[key] = UNSET_NOTES["lora_target_modules"]
        elif key in ("reward_funcs", "reward_weights") or key in REWARD_PARAM_KEYS:
            continue  # below, together
        elif key in UNMAPPED_REASONS:
            out.unmapped[key] = UNMAPPED_REASONS[key]
        elif key in CODE_KEYS:
            out.unmapped[key] = f"a parameter of open-r1's code rewards: {CODE_REASON}"
        elif key in LOGGING_KEYS:
            _put(out, key, f"logging.{key}", value)
        elif key in training_fields and key != "phases":
            _put(out, key, f"training.{key}", _training_value(out, key, value))
        else:
            suggestions -= 1
            out.unmapped[key] = (
                "not a key of TRL 1.16's GRPOConfig/ModelConfig/ScriptArguments nor of open-r1's GRPO configs"
                f"{suggest(key, known) if suggestions >= 0 else ''}"
            )
    _translate_rewards(raw, out)
    if raw.get("use_vllm") is True and "vllm_mode" not in raw and OPEN_R1_MARKERS & set(raw):
        out.recipe["training"]["vllm_mode"] = "server"
        out.notes["use_vllm"] = UNSET_NOTES["vllm_mode"]
    if use_peft:  # TRL ModelConfig's defaults where the file sets none
        out.recipe["peft"] = {**TRL_LORA_DEFAULTS, **(out.recipe["peft"] or {})}
    if not out.recipe["logging"]:
        del out.recipe["logging"]
    data = out.recipe["data"]
    out.recipe["data"] = {key: data[key] for key in sorted(data, key=DATA_ORDER.index)}
    return out


def _put(out: Translation, key: str, path: str, value: Any) -> None:
    """Set `path` (`section.key` or `section.key.sub`) in the recipe and record where `key` went."""
    other = next((source for source, target in out.mapped.items() if target == path), None)
    if other is not None:  # `warmup_ratio` and `warmup_steps`, `torch_dtype` and `dtype`, ...
        out.unmapped[key] = f"`{other}` also sets {path}: the recipe keeps its value, not {value!r}"
        return
    section, *rest = path.split(".")
    target = out.recipe.get(section)
    if target is None:
        target = out.recipe[section] = {}
    for part in rest[:-1]:
        target = target.setdefault(part, {})
    target[rest[-1]] = value
    out.mapped[key] = path
    if key in NOTES:
        out.notes[key] = NOTES[key]


def _training_value(out: Translation, key: str, value: Any) -> Any:
    if key == "scale_rewards" and isinstance(value, bool):
        out.notes[key] = NOTES[key]
        return "group" if value else "none"
    return value


def _translate_rewards(raw: dict[str, Any], out: Translation) -> None:
    """`reward_funcs` + `reward_weights` + the reward parameter keys -> `rewards: [{name, weight, params}]`."""
    names = raw.get("reward_funcs")
    if names is None and OPEN_R1_MARKERS & set(raw):
        names = list(OPEN_R1_DEFAULT_REWARDS)
        out.notes["reward_funcs"] = "not set: open-r1's default (accuracy, format, tag_count)"
        out.mapped["reward_funcs"] = "rewards"
    if isinstance(names, str):
        names = [names]
    if names is not None and not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        out.unmapped["reward_funcs"] = (
            f"{names!r} is not a reward name or a list of them (TRL reads a list of names); no rewards translated: "
            "write `rewards:` in the recipe"
        )[:400]
        names = None
    names = list(names or [])
    weights = raw.get("reward_weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(names)):
        out.unmapped["reward_weights"] = (
            f"{len(weights) if isinstance(weights, list) else weights!r} weights for {len(names)} reward_funcs "
            "(TRL refuses this too); each reward gets weight 1"
        )
        weights = None
    elif weights is not None:
        out.mapped["reward_weights"] = "rewards[i].weight"
    used_keys: set[str] = set()
    for index, name in enumerate(names):
        weight = 1.0 if weights is None else weights[index]
        spec = REWARDS.get(name)
        if spec is None and isinstance(name, str) and name.startswith("rewards."):
            spec = RewardMap(name[len("rewards.") :], "this package's registry, by its module path")
        if spec is None or spec.name is None:
            why = spec.note if spec is not None else (
                "an import path to your own function: register it with rewards.register() and name it in `rewards:`"
                if "." in str(name) else "not a reward name of open-r1 or of `trl grpo`"
            )  # fmt: skip
            out.unmapped[f"reward_funcs: {name}"] = f"{why} (its weight {weight} goes with it)"
            continue
        params = dict(spec.params)
        for param, (source_key, default) in spec.from_keys.items():
            params[param] = raw.get(source_key, default)
            if source_key in raw:
                used_keys.add(source_key)
                out.mapped[source_key] = f"rewards[{len(out.recipe['rewards'])}].params.{param}"
        entry: dict[str, Any] = {"name": spec.name, "weight": weight}
        if params:
            entry["params"] = params
        out.recipe["rewards"].append(entry)
    if names and "reward_funcs" not in out.mapped:
        out.mapped["reward_funcs"] = "rewards"
    translated = [f"{name} -> {REWARDS[name].name} ({REWARDS[name].note})" for name in names
                  if name in REWARDS and REWARDS[name].name is not None]  # fmt: skip
    if translated:
        out.notes["reward_funcs"] = "; ".join(filter(None, [out.notes.get("reward_funcs"), *translated]))
    for key in REWARD_PARAM_KEYS & set(raw) - used_keys:
        owner = next(name for name, spec in REWARDS.items() if key in {k for k, _ in spec.from_keys.values()})
        out.unmapped[key] = f"a parameter of open-r1's `{owner}` reward, which reward_funcs does not list"


# ---------------------------------------------------------------------------------------------------------------
# `prorl-trl convert`
# ---------------------------------------------------------------------------------------------------------------


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Translate a flat GRPO config (open-r1's recipes/*/grpo/*.yaml, `trl grpo --config`) into a recipe. Every "
        "key is translated or listed with the reason it is not; the written recipe starts with that list."
    )
    parser.add_argument("config", help="flat GRPO config (YAML)")
    parser.add_argument("-o", "--output", default=None, help="recipe file to write; default: print it")


def run_convert(args: argparse.Namespace) -> int:
    from .reading import read_recipe_file

    output = Path(args.output) if args.output is not None else None
    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        what = "is a folder" if output.is_dir() else f"is in {output.parent}/, which does not exist"
        print(f"error: -o {output} {what}: name the recipe file to write (e.g. -o recipes/my_run.yaml) in a folder "
              "that exists. Nothing was written.", file=sys.stderr)  # fmt: skip
        return 2
    raw = read_recipe_file(args.config, kind="config")
    translation = translate_flat_config(raw, source=Path(args.config).name)
    text = translation.to_yaml(args.config)
    if output is None:
        print(text, end="")
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as error:
            print(f"error: -o {output}: cannot be written ({error.strerror or error}). Nothing was written.",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"wrote {output}; check it with `prorl-trl validate {output}`")
    if translation.report():
        print(translation.report(), file=sys.stderr)
    return 0
