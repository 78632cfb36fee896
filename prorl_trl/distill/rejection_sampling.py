"""Rejection sampling: draw n completions per problem, grade them with a reward, keep one correct one per problem.

The building blocks of distillation (`prorl_trl.distill`), usable on their own, e.g. to build an SFT set from any
sampler: `grade_samples` calls a reward exactly as TRL does, `select_correct` keeps the first correct sample of
every problem, `rejection_sample` chains them and counts what was kept, and `teacher_sample_fn` draws from a model
with the evaluation sampler (`prorl_trl.evaluation.sampling`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..evaluation.sampling import completion_for_reward

SampleFn = Callable[[list[Any], int], list[list[str]]]
"""`sample_fn(prompts, n)` -> `n` completion texts for every prompt (the teacher's sampler, or a stand-in)."""
RewardFn = Callable[..., list[float | None]]


@dataclass
class RejectionStats:
    """What rejection sampling kept: problems, problems with a kept sample, and the teacher's sample accuracy."""

    num_problems: int
    num_kept: int
    num_samples: int
    num_correct_samples: int

    @property
    def kept_fraction(self) -> float:
        return self.num_kept / self.num_problems if self.num_problems else 0.0

    @property
    def teacher_accuracy(self) -> float:
        return self.num_correct_samples / self.num_samples if self.num_samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_problems": self.num_problems,
            "num_kept": self.num_kept,
            "kept_fraction": self.kept_fraction,
            "num_samples": self.num_samples,
            "num_correct_samples": self.num_correct_samples,
            "teacher_accuracy": self.teacher_accuracy,
        }


# ------------------------------------------------------------------------------------------- grade and select


def correctness_test(reward_fn: RewardFn, correct_threshold: float | None = None) -> RewardFn:
    """A function with the reward's call signature returning, per completion, whether it is correct.

    With `correct_threshold`: reward >= threshold. Otherwise the registry's test (`rewards.is_correct`: the reward's
    own `is_correct`, or reward == its `correct` value; e.g. `kk_logic` is correct only at the full score), and for a
    plain function without either, reward > 0. A `None` reward (the reward does not apply) is never correct.
    """
    if correct_threshold is None and (
        callable(getattr(reward_fn, "is_correct", None)) or hasattr(reward_fn, "correct")
    ):
        from rewards import is_correct

        return lambda **kwargs: [verdict is True for verdict in is_correct(reward_fn, **kwargs)]

    def test(**kwargs: Any) -> list[bool]:
        scores = reward_fn(**kwargs)
        if correct_threshold is None:
            return [score is not None and score > 0 for score in scores]
        return [score is not None and score >= correct_threshold for score in scores]

    return test


def grade_samples(
    reward_fn: RewardFn,
    problems: Sequence[dict[str, Any]],
    samples: Sequence[Sequence[str]],
    correct_threshold: float | None = None,
    tokenizer: Any = None,
    chunk_size: int = 1024,
) -> list[list[bool]]:
    """Whether every sample is correct, asking the reward the way TRL calls it (`prompts`, `completions`,
    `completion_ids` and the dataset columns as keyword arguments).

    `problems[i]` is a dataset row (its `prompt` plus gold columns) and `samples[i]` its completion texts. The
    completions reach the reward as messages when the prompt is conversational, as in TRL. `completion_ids` come
    from `tokenizer` (empty lists without one). Calls go in chunks of `chunk_size` completions.
    """
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems but samples for {len(samples)}: one list of samples per problem.")
    test = correctness_test(reward_fn, correct_threshold)
    flat = [(i, text) for i, texts in enumerate(samples) for text in texts]
    columns = [key for key in (problems[0] if problems else {}) if key not in ("prompt", "completion")]
    verdicts: list[bool] = []
    for start in range(0, len(flat), chunk_size):
        chunk = flat[start : start + chunk_size]
        prompts = [problems[i]["prompt"] for i, _ in chunk]
        texts = [text for _, text in chunk]
        completion_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] if tokenizer else [] for t in texts]
        result = test(
            prompts=prompts,
            completions=[completion_for_reward(p, t) for p, t in zip(prompts, texts)],
            completion_ids=completion_ids,
            **{key: [problems[i][key] for i, _ in chunk] for key in columns},
        )
        if len(result) != len(chunk):
            raise ValueError(f"The reward returned {len(result)} values for {len(chunk)} completions.")
        verdicts.extend(result)
    nested, position = [], 0
    for texts in samples:
        nested.append(verdicts[position : position + len(texts)])
        position += len(texts)
    return nested


def select_correct(correct: Sequence[Sequence[bool]]) -> list[int | None]:
    """Index of the kept sample of every problem: its first correct one, or None when no sample is correct.

    Samples are drawn independently, so the first correct one is a uniformly random choice among the correct ones.
    """
    return [next((j for j, verdict in enumerate(row) if verdict), None) for row in correct]


def distilled_rows(
    problems: Sequence[dict[str, Any]], samples: Sequence[Sequence[str]], kept: Sequence[int | None]
) -> list[dict[str, Any]]:
    """One row per problem with a kept sample: the problem's columns plus `completion` (messages if conversational)."""
    return [
        {**problem, "completion": completion_for_reward(problem["prompt"], texts[index])}
        for problem, texts, index in zip(problems, samples, kept)
        if index is not None
    ]


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def rejection_sample(
    problems: Sequence[dict[str, Any]],
    sample_fn: SampleFn,
    reward_fn: RewardFn,
    num_samples: int,
    correct_threshold: float | None = None,
    tokenizer: Any = None,
) -> tuple[list[dict[str, Any]], RejectionStats]:
    """Draw `num_samples` per problem, grade them, keep the first correct one: the distilled rows and their stats."""
    problems = [dict(problem) for problem in problems]
    samples = sample_fn([problem["prompt"] for problem in problems], num_samples)
    if len(samples) != len(problems) or any(len(texts) != num_samples for texts in samples):
        raise ValueError(f"sample_fn must return {num_samples} completions for each of the {len(problems)} prompts.")
    correct = grade_samples(reward_fn, problems, samples, correct_threshold, tokenizer=tokenizer)
    kept = select_correct(correct)
    stats = RejectionStats(
        num_problems=len(problems),
        num_kept=sum(index is not None for index in kept),
        num_samples=sum(len(texts) for texts in samples),
        num_correct_samples=sum(sum(row) for row in correct),
    )
    return distilled_rows(problems, samples, kept), stats


# ------------------------------------------------------------------------------------------- teacher sampling


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def teacher_sample_fn(
    teacher: str,
    samples_dir: str | Path,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_completion_length: int = 1024,
    batch_size: int = 64,
    seed: int = 0,
    use_vllm: bool = False,
    device: str = "auto",
    name: str = "teacher",
    trust_remote_code: bool = False,
) -> SampleFn:
    """A `sample_fn` drawing from the model at `teacher` with the evaluation sampler (`prorl_trl.evaluation`).

    Samples go to `<samples_dir>/samples/<name>.jsonl` as they are drawn, so an interrupted run draws only what is
    missing (the sampler refuses to resume with other sampling settings or other prompts). Conversational prompts
    are rendered with the teacher's chat template. The model is loaded for the call and released after it.
    """
    from ..evaluation.runner import ModelSpec, check_resumable, sample_model
    from ..evaluation.sampling import SamplingSettings, vllm_available

    if use_vllm and not vllm_available():
        raise RuntimeError("use_vllm=True but vLLM is not importable: `pip install -e .[vllm]`, or sample without it.")
    spec = ModelSpec(name, teacher)

    def settings_for(num_samples: int) -> SamplingSettings:
        return SamplingSettings(
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            max_completion_length=max_completion_length,
            batch_size=batch_size,
            seed=seed,
        )

    check_resumable(samples_dir, [spec], settings_for(1))  # stored samples drawn otherwise: refuse before any work

    def sample(prompts: list[Any], num_samples: int) -> list[list[str]]:
        problems = [{"problem_id": str(index), "prompt": prompt} for index, prompt in enumerate(prompts)]
        records, _ = sample_model(
            spec,
            problems,
            settings_for(num_samples),
            samples_dir,
            backend="vllm" if use_vllm else "transformers",
            device=device,
            trust_remote_code=trust_remote_code,
        )
        grouped: list[list[str]] = [[""] * num_samples for _ in prompts]
        for record in records:
            grouped[int(record["problem_id"])][int(record["sample_index"])] = record["completion"]
        if device.startswith("cuda") or device == "auto":
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return grouped

    return sample
