"""The table of built-in rewards: name -> factory, in one screen. Formulas and sources: ../shared/notes/reward-formulas.md.

Importing this module registers them in `rewards.registry.BUILTIN_REWARDS` (the package `__init__` does).
"""

from __future__ import annotations

from .correctness import BoxedAnswer, MathEquivalence
from .formatting import ReasoningSteps, TagCount, ThinkAnswerFormat
from .length import CosineScaled, KimiLength, RepetitionPenalty, SoftOverlong
from .logic import KKLogic
from .registry import BUILTIN_REWARDS

BUILTIN_REWARDS.update({
    "boxed_answer": BoxedAnswer,  # seed rule: last \boxed{} as a float == gold number; +1 / -1
    "math_equivalence": MathEquivalence,  # math-verify equivalence, numeric fast path, bounded per item; 1 / 0
    "think_answer_format": ThinkAnswerFormat,  # open-r1 format_reward; 1 / 0
    "tag_count": TagCount,  # open-r1: 0.25 per tag present exactly once
    "reasoning_steps": ReasoningSteps,  # open-r1: min(1, steps / 3)
    "cosine_scaled": CosineScaled,  # cosine of token length, direction by correctness
    "kimi_length": KimiLength,  # Kimi k1.5 length reward per prompt group
    "repetition_penalty": RepetitionPenalty,  # token n-gram repetition (trl.rewards)
    "soft_overlong": SoftOverlong,  # DAPO Eq. 13 (trl.rewards)
    "kk_logic": KKLogic,  # Logic-RL knights & knaves: 3 / -0.5 / -1 / -3
})
