"""Reward functions for TRL's `GRPOTrainer`, with a registry. Importable on its own (no `prorl_trl` import).

```python
from rewards import get_reward
overlong = get_reward("soft_overlong", max_completion_len=1024, soft_punish_cache=256)
trainer = GRPOTrainer(..., reward_funcs=[get_reward("math_equivalence"), overlong], args=GRPOConfig(...))
```
or, from TRL's command line: `trl grpo --reward_funcs rewards.boxed_answer rewards.tag_count ...` (the module-level
instances below, built with default parameters).

Every reward takes TRL's keyword arguments (`prompts`, `completions`, `completion_ids`, dataset columns,
`**kwargs`), accepts plain-text and conversational completions, reads the gold answer from the column `answer`
(`answer_key=` to change), counts lengths in tokens, never raises on a bad completion and has a unique `__name__`
(TRL logs `rewards/<__name__>/mean`); `check_columns(reward_funcs, dataset.column_names)` raises a missing gold
column's error before training starts. Correctness rewards (`boxed_answer`, `math_equivalence`, `kk_logic`) also
have `is_correct(...)` -> `list[bool | None]` and the values `correct` / `incorrect`.

Heavy dependencies load lazily: math-verify/sympy run in a child process on the first symbolic comparison, and
`trl.rewards` is imported on first use.
"""

from __future__ import annotations

from . import builtin  # noqa: F401  (fills BUILTIN_REWARDS)
from ._base import CorrectnessReward, MissingColumnError, Reward, check_columns
from ._numbers import as_rational
from ._text import completion_text, extract_boxed, gold_number, gold_text, normalize_answer
from .correctness import BoxedAnswer, MathEquivalence
from .formatting import ReasoningSteps, TagCount, ThinkAnswerFormat
from .length import CosineScaled, KimiLength, RepetitionPenalty, SoftOverlong
from .logic import KKLogic
from .registry import BUILTIN_REWARDS, available, get_reward, register

# Default instances, so a dotted path (`rewards.boxed_answer`) works wherever TRL accepts one.
boxed_answer = BoxedAnswer()
math_equivalence = MathEquivalence()
think_answer_format = ThinkAnswerFormat()
tag_count = TagCount()
reasoning_steps = ReasoningSteps()
cosine_scaled = CosineScaled()
kimi_length = KimiLength()
repetition_penalty = RepetitionPenalty()
soft_overlong = SoftOverlong()
kk_logic = KKLogic()


def is_correct(reward, **reward_kwargs) -> list[bool | None]:
    """Binary correctness from any correctness reward (anything with `is_correct`, or with `correct` values).

    Dynamic sampling uses this to keep only groups whose correctness varies. For a reward without `is_correct`, a
    completion is correct when its reward equals `reward.correct`.
    """
    if callable(getattr(reward, "is_correct", None)):
        return reward.is_correct(**reward_kwargs)
    if not hasattr(reward, "correct"):
        raise TypeError(f"{reward!r} is not a correctness reward (no is_correct(...) and no `correct` value)")
    return [None if value is None else value == reward.correct for value in reward(**reward_kwargs)]


__all__ = [
    "BUILTIN_REWARDS",
    "BoxedAnswer",
    "CorrectnessReward",
    "CosineScaled",
    "KKLogic",
    "KimiLength",
    "MathEquivalence",
    "MissingColumnError",
    "ReasoningSteps",
    "RepetitionPenalty",
    "Reward",
    "SoftOverlong",
    "TagCount",
    "ThinkAnswerFormat",
    "as_rational",
    "available",
    "boxed_answer",
    "check_columns",
    "completion_text",
    "cosine_scaled",
    "extract_boxed",
    "get_reward",
    "gold_number",
    "gold_text",
    "is_correct",
    "kimi_length",
    "kk_logic",
    "math_equivalence",
    "normalize_answer",
    "reasoning_steps",
    "register",
    "repetition_penalty",
    "soft_overlong",
    "tag_count",
    "think_answer_format",
]
