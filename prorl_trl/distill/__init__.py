"""Distillation by rejection sampling: sample a teacher, keep one verified completion per problem, SFT the student.

Why: small models often collapse under direct RL (on Knights-and-Knaves a 1.5B instruct model learned to write an
empty thinking block and guess). Fine-tuning them first on a stronger RL-trained teacher's *verified* solutions gives
RL a starting policy that already writes the format and is sometimes right, so the rewards carry signal. Only
completions the task's reward marks correct are kept, at most one per problem, so the student imitates successes and
the distilled set stays as diverse as the problems.

Steps: `rejection_sample` (`prorl_trl.distill.rejection_sampling`: teacher samples graded by the reward registry,
one correct sample kept per problem) -> `distilled.jsonl` -> `train_student` (TRL `SFTTrainer`, prompt-completion
format, loss on the completion only; LoRA merged before saving). `distill` chains them; `run_distill` is the
`prorl-trl distill` command; `run_distill_section` runs a recipe's `distill:` section before its ProRL phases.
"""

from .cli import add_distill_arguments, run_distill
from .config import DistillConfig
from .run import DISTILLED_FILE, SUMMARY_FILE, distill, load_problems
from .section import check_distill_section, distill_config_from_section, run_distill_section

__all__ = [
    "DISTILLED_FILE", "SUMMARY_FILE", "DistillConfig", "add_distill_arguments", "check_distill_section", "distill",
    "distill_config_from_section", "load_problems", "run_distill", "run_distill_section",
]  # fmt: skip
