"""Prompt templates: one problem text -> a chat message list (instruct models) or one plain string (base models).

Placeholders are `{question}` and `{system}`, substituted literally (no `str.format`), so LaTeX braces such as
`\\boxed{}` need no escaping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

THINK_ANSWER_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. The "
    "Assistant first thinks through the reasoning process and then gives the User the answer. The reasoning and the "
    "answer are enclosed in <think> </think> and <answer> </answer> tags, i.e. "
    "<think> reasoning process here </think><answer> answer here </answer>."
)

# Logic-RL's K&K instruction (same content and answer format as Logic-RL's `make_prefix`, reworded).
KK_SYSTEM = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in its mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
    "</answer>. Now the user asks you to solve a logical reasoning problem. After thinking, when you finally reach a "
    "conclusion, clearly state the identity of each character within <answer> </answer> tags, i.e., "
    "<answer> (1) Zoey is a knight\n(2) ... </answer>."
)


@dataclass(frozen=True)
class PromptTemplate:
    """How a problem becomes a prompt. `plain` is the base-model text (without a `{system}` slot, a system prompt
    goes before it, then a blank line); None: `system`, a blank line, `user`."""

    user: str
    system: str | None = None
    plain: str | None = None
    help: str = ""


TEMPLATES: dict[str, PromptTemplate] = {
    "raw": PromptTemplate(user="{question}", help="The problem text unchanged (already templated data)."),
    "boxed_math": PromptTemplate(
        user="{question}\n" + BOXED_INSTRUCTION,
        plain="Question: {question}\n" + BOXED_INSTRUCTION + "\nAnswer:",
        help="ProRL/seed math prompt asking for the final answer in \\boxed{} (GSM8K, MATH-500).",
    ),
    "r1_distill_math": PromptTemplate(
        user="{question}\nPlease reason step by step, and put your final answer within \\boxed{}.",
        help="DeepSeek-R1-Distill math prompt (no system prompt, as DeepSeek recommends).",
    ),
    "think_answer": PromptTemplate(
        user="{question}",
        system=THINK_ANSWER_SYSTEM,
        plain="{system}\nUser: {question}\nAssistant:",
        help="R1-Zero style system prompt with <think>/<answer> tags.",
    ),
    "think_answer_boxed": PromptTemplate(
        user="{question}\nPut the final answer in \\boxed{} inside the <answer> </answer> tags.",
        system=THINK_ANSWER_SYSTEM,
        plain="{system}\nUser: {question}\nPut the final answer in \\boxed{} inside the <answer> </answer> tags.\nAssistant:",
        help="`think_answer` plus a request for \\boxed{}, so both format and boxed-answer rewards apply.",
    ),
    "kk_logic_rl": PromptTemplate(
        user="{question}",
        system=KK_SYSTEM,
        plain="{system}\nUser: {question}\nAssistant:",
        help="Logic-RL knights-and-knaves prompt with <think>/<answer> tags.",
    ),
}


def available_templates() -> list[str]:
    return sorted(TEMPLATES)


def render_prompt(
    question: Any, template: str | PromptTemplate, prompt_format: str = "chat", system_prompt: str | None = None
) -> str | list[dict[str, str]]:
    """The prompt for one problem: a list of messages (`chat`) or one string (`plain`).

    A `question` that is already a message list (conversational source data) is passed through for `chat`.
    """
    spec = TEMPLATES[template] if isinstance(template, str) else template
    system = spec.system if system_prompt is None else system_prompt
    if isinstance(question, list):
        if prompt_format != "chat":
            raise ValueError("a conversational prompt (message list) needs prompt_format 'chat'")
        return question
    user = spec.user.replace("{question}", str(question))
    if prompt_format == "chat":
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": user}]
    if spec.plain is None:
        return f"{system}\n\n{user}" if system else user
    if "{system}" in spec.plain:
        return spec.plain.replace("{system}", system or "").replace("{question}", str(question)).lstrip("\n")
    text = spec.plain.replace("{question}", str(question))
    return f"{system}\n\n{text}" if system else text  # a plain form without a slot: the system text goes first
