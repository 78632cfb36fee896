"""Running a distillation: data, teacher sampling (sharded across processes), rejection, student fine-tuning.

`distill(config)` is the whole run; `config` holds its settings (`DistillConfig`), `cli` the command line and
`section` the recipe section. Everything here works from the settings alone, and resumes from what `output_dir` holds.
What it writes there is recorded first in the folder's `.prorl_manifest.json` (kind `distill`), so `prorl-trl
distill` can tell its own folder from one holding other files (`DISTILL`, checked first by `distill`).
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from ..data.spec import DataSection
from ..trainer.manifest import OutputKind, present_outputs, record_outputs
from .config import DistillConfig
from .rejection_sampling import (
    RejectionStats,
    RewardFn,
    SampleFn,
    load_tokenizer,
    read_jsonl,
    rejection_sample,
    teacher_sample_fn,
    write_jsonl,
)
from .sft import MODEL_DIR, SFT_DIR, train_student

logger = logging.getLogger("prorl_trl.distill")

DISTILLED_FILE = "distilled.jsonl"
SUMMARY_FILE = "distill_summary.json"
# Below this fraction of problems kept, the student learns from a sliver of the data: say so.
FEW_KEPT_FRACTION = 0.1


def legacy_distillation(folder: Path) -> list[str]:
    """The outputs of a distillation from before manifests: evidence only it leaves is its summary or its teacher's
    samples (`samples/teacher-part<i>.meta.json`); then the names it writes that are there (never through a link)."""
    samples = folder / "samples"
    sampled = samples.is_dir() and not samples.is_symlink() and any(samples.glob("teacher-part*.meta.json"))
    if not (folder / SUMMARY_FILE).is_file() and not sampled:
        return []
    parts = sorted(path.name for path in folder.iterdir() if DISTILL.pattern.fullmatch(path.name))
    return present_outputs(folder, [*DISTILL.writes, *parts])


DISTILL = OutputKind(
    "distill", "--out", legacy_distillation,
    (DISTILLED_FILE, SUMMARY_FILE, "samples/", f"{SFT_DIR}/", f"{MODEL_DIR}/"), re.compile(r"distill_part\d+\.jsonl?"),
)  # fmt: skip


def distill_outputs(num_processes: int) -> list[str]:
    """Everything `distill` may create in its output folder with `num_processes` processes (each writes a part)."""
    parts = [f"distill_part{index}{suffix}" for index in range(num_processes) for suffix in (".jsonl", ".json")]
    return [*DISTILL.writes, *parts]


class TooFewKept(RuntimeError):
    """Fewer problems kept a verified completion than `min_kept`: the student is not fine-tuned (exit status 1)."""

    exit_status = 1


def check_kept(config: DistillConfig, summary: dict[str, Any], rows_path: Path) -> None:
    """Warn when few problems survived rejection; raise `TooFewKept` below `config.min_kept`."""
    kept, total = summary.get("num_kept", 0), summary.get("num_problems", 0)
    share = f"{kept} of {total} problems ({100 * kept / total:.1f}%)" if total else f"{kept} problems"
    advice = "raise `samples` or `temperature`, check the reward and the teacher"
    if total and kept / total < FEW_KEPT_FRACTION:
        logger.warning(
            "Only %s kept a verified completion: the student would be fine-tuned on %d example(s). To refuse such "
            "runs, set --min-kept (distill.min_kept); to keep more, %s.", share, kept, advice,
        )  # fmt: skip
    if kept == 0 and config.min_kept <= 0:  # `min_kept: 0` accepts few rows, but SFT needs at least one
        raise TooFewKept(
            f"distillation kept none of {total} problems with a verified completion: the student is not fine-tuned "
            f"(there is nothing to fine-tune on). {advice[0].upper()}{advice[1:]}."
        )
    if kept < config.min_kept:
        raise TooFewKept(
            f"distillation kept {share} with a verified completion, fewer than min_kept = {config.min_kept}: the "
            f"student is not fine-tuned. The kept rows are in {rows_path}; {advice}, or lower --min-kept."
        )


def _data_section(config: DistillConfig) -> Any:
    return DataSection(builder=config.dataset, **config.dataset_kwargs)


def load_problems(config: DistillConfig) -> Any:
    """The training problems: the data builder's train split (`prompt` + gold columns), as in a recipe's `data:`."""
    from ..data import build_dataset

    data = _data_section(config)
    tokenizer = load_tokenizer(config.teacher, config.trust_remote_code) if data.max_prompt_tokens else None
    dataset = build_dataset(data, "train", tokenizer)
    if config.max_problems is not None:
        dataset = dataset.select(range(min(config.max_problems, len(dataset))))
    return dataset


def check_names(config: DistillConfig, check_dataset: bool = True, check_reward: bool = True) -> None:
    """Raise `ValueError` for an unknown data builder, builder option or reward, before anything is loaded."""
    problems = []
    if check_dataset:
        from ..data import BUILDERS

        if config.dataset not in BUILDERS:
            problems.append(
                f"unknown dataset {config.dataset!r}{close_match(config.dataset, BUILDERS)}; "
                f"available: {', '.join(sorted(BUILDERS))}"
            )
        allowed = [spec.name for spec in fields(DataSection) if spec.name != "builder"]
        for key in config.dataset_kwargs:
            if key not in allowed:
                problems.append(
                    f"dataset_kwargs: unknown key {key!r}{close_match(key, allowed)}; allowed: {', '.join(allowed)}"
                )
    if check_reward:
        from rewards import available

        if config.reward not in available():
            problems.append(
                f"unknown reward {config.reward!r}{close_match(config.reward, available())}; "
                f"available: {', '.join(available())}"
            )
    if problems:
        raise ValueError("; ".join(problems) + ".")


def close_match(name: str, candidates: Any) -> str:
    match = difflib.get_close_matches(str(name), list(candidates), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _sampling_key(config: DistillConfig) -> dict[str, Any]:
    """Settings that decide the distilled set: a saved set is reused only when they all match."""
    keys = (
        "teacher",
        "dataset",
        "dataset_kwargs",
        "reward",
        "reward_kwargs",
        "correct_threshold",
        "max_problems",
        "samples",
        "temperature",
        "top_p",
        "max_completion_length",
        "seed",
    )
    return _as_json({key: getattr(config, key) for key in keys})


def _as_json(value: Any) -> Any:
    """`value` as it reads back from the summary file (tuples become lists), so saved and live settings compare."""
    return json.loads(json.dumps(value, default=str))


def check_teacher(teacher: str) -> None:
    looks_local = teacher.startswith(("/", ".", "~")) or teacher.count("/") != 1
    if looks_local and not Path(teacher).expanduser().exists():
        raise FileNotFoundError(
            f"Teacher checkpoint not found: {teacher!r}. Set `teacher` (--teacher, or "
            "`distill.teacher` in a recipe) to an RL-trained model folder or a hub id."
        )


def distill(
    config: DistillConfig,
    problems: Any = None,
    sample_fn: SampleFn | None = None,
    reward_fn: RewardFn | None = None,
    allow_other_files: bool = False,
) -> dict[str, Any]:
    """Sample the teacher, keep one correct completion per problem, write them, fine-tune the student.

    `problems` (rows with `prompt` + gold columns), `sample_fn` and `reward_fn` default to the data builder, the
    teacher sampler and the reward registry named in `config`; passing them is how tests and notebooks plug in their
    own. Work already in `output_dir` is reused (compared by `config` only, not by injected functions or rows): a
    finished run with the same settings returns at once, a distilled set drawn with the same sampling settings is
    trained on without sampling again, and interrupted teacher sampling resumes from `samples/`. Returns the
    summary also written to `distill_summary.json` (kept fraction, teacher accuracy, SFT losses, `student_path`).
    An `output_dir` that holds anything else is refused first (`OutputFolderError`; `allow_other_files`: as
    `--allow-other-files`), so nothing of another run or of the user's is written over, deleted or mixed in.
    """
    from accelerate import PartialState

    from ..trainer.output_guard import check_output_folder

    if config.student is None:
        raise ValueError("No student: set `student` (--student), or run the section from a recipe with a model.")
    check_output_folder(config.output_dir, DISTILL, allow_other_files=allow_other_files)  # every process, read-only
    check_names(config, check_dataset=problems is None, check_reward=reward_fn is None)
    if sample_fn is None:
        check_teacher(config.teacher)
    if reward_fn is None:
        from rewards import get_reward

        reward_fn = get_reward(config.reward, **config.reward_kwargs)
    output_dir = Path(config.output_dir)
    summary_path, rows_path = output_dir / SUMMARY_FILE, output_dir / DISTILLED_FILE
    previous = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    settings = _as_json({spec.name: getattr(config, spec.name) for spec in fields(config)})
    if previous.get("settings") == settings and (Path(previous.get("student_path", "")) / "config.json").is_file():
        logger.warning("Distillation already done in %s; reusing %s.", output_dir, previous["student_path"])
        return previous
    state = PartialState(cpu=config.use_cpu)
    if state.is_main_process:  # before anything is written
        record_outputs(output_dir, distill_outputs(state.num_processes), kind=DISTILL)
    state.wait_for_everyone()
    if previous.get("sampling") == _sampling_key(config) and rows_path.is_file():
        logger.warning("Reusing the distilled set in %s (same sampling settings).", rows_path)
    else:
        _build_distilled_set(config, problems, sample_fn, reward_fn, state)
    summary = json.loads(summary_path.read_text())
    check_kept(config, summary, rows_path)
    model_dir, losses = train_student(config, read_jsonl(rows_path), config.student)
    _free_memory()
    summary.update(losses, student=config.student, student_path=str(model_dir), settings=settings)
    if state.is_main_process:
        summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def _free_memory() -> None:
    """Release the student trainer's GPU memory now (Trainer objects hold reference cycles): a recipe's RL phases
    load the model again right after distillation."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device(config: DistillConfig, state: Any) -> str:
    import torch

    if config.use_cpu or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{state.local_process_index}"


def _build_distilled_set(
    config: DistillConfig, problems: Any, sample_fn: SampleFn | None, reward_fn: RewardFn, state: Any
) -> None:
    """Sample, grade and select, writing `distilled.jsonl` and the summary's counts.

    Under `accelerate launch` every process samples every num_processes-th problem on its own GPU, then the main
    process merges the parts in process order (vLLM sampling runs on the main process only).
    """
    output_dir = Path(config.output_dir)
    num_shards = 1 if config.use_vllm else state.num_processes
    part = output_dir / f"distill_part{state.process_index}"
    tokenizer = None
    if sample_fn is None and state.process_index < num_shards:
        tokenizer = load_tokenizer(config.teacher, config.trust_remote_code)
        sample_fn = teacher_sample_fn(
            config.teacher,
            output_dir,
            temperature=config.temperature,
            top_p=config.top_p,
            max_completion_length=config.max_completion_length,
            batch_size=config.sampling_batch_size,
            seed=config.seed + state.process_index,
            use_vllm=config.use_vllm,
            device=_device(config, state),
            name=f"teacher-part{state.process_index}",
            trust_remote_code=config.trust_remote_code,
        )
    problems = [dict(row) for row in (load_problems(config) if problems is None else problems)]
    if state.process_index < num_shards:
        shard = problems[state.process_index :: num_shards]
        rows, stats = rejection_sample(
            shard, sample_fn, reward_fn, config.samples, config.correct_threshold, tokenizer
        )
        write_jsonl(rows, part.with_suffix(".jsonl"))
        part.with_suffix(".json").write_text(json.dumps(asdict(stats)))
    state.wait_for_everyone()
    if state.is_main_process:
        parts = [output_dir / f"distill_part{index}" for index in range(num_shards)]
        rows = [row for path in parts for row in read_jsonl(path.with_suffix(".jsonl"))]
        counts = [json.loads(path.with_suffix(".json").read_text()) for path in parts]
        stats = RejectionStats(**{key: sum(count[key] for count in counts) for key in counts[0]})
        write_jsonl(rows, output_dir / DISTILLED_FILE)
        summary = {"sampling": _sampling_key(config), **stats.to_dict()}
        (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        for path in parts:
            path.with_suffix(".jsonl").unlink()
            path.with_suffix(".json").unlink()
        logger.warning(
            "Distillation kept %d of %d problems (%.1f%%); teacher sample accuracy %.3f.",
            stats.num_kept,
            stats.num_problems,
            100 * stats.kept_fraction,
            stats.teacher_accuracy,
        )
    state.wait_for_everyone()
