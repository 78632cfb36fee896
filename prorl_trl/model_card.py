"""Model cards for the models a run writes (`final/` of `prorl-trl train`, `model/` of `prorl-trl distill`).

TRL's card names the base model only when it is a hub id, so a run from a local folder said "fine-tuned version of
[None]", and nothing said which recipe or settings made the model. These cards name the base (hub id or path) and
how the model was made: the recipe file and its phases, or the teacher, data and reward of a distillation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CARD_NAME = "README.md"


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def base_model_text(name: str) -> str:
    """A hub id as a link to its page, a local path as code."""
    return f"[{name}](https://huggingface.co/{name})" if _is_hub_id(name) else f"`{name}` (a local folder)"


def write_model_card(folder: str | Path, base_model: str, summary: str, details: list[str]) -> Path:
    """Write `<folder>/README.md`: front matter (the base model when it is a hub id), the base, how the model was
    made (`summary`, one sentence), then `details` (markdown lines: settings, tables)."""
    folder = Path(folder)
    front = ["---", "library_name: transformers", "tags:", "- prorl-trl", "- trl"]
    if _is_hub_id(base_model):
        front.insert(2, f"base_model: {base_model}")
    lines = front + ["---", "", f"# {folder.name}", "", f"Fine-tuned from {base_model_text(base_model)}. {summary}", ""]
    card = folder / CARD_NAME
    card.write_text("\n".join(lines + details) + "\n")
    return card


def phase_table(phases: list[Any]) -> list[str]:
    """The resolved phases as a markdown table (what each phase sampled and trained)."""
    rows = [
        "| phase | steps | temperature | top_p | num_generations | max_completion_length | overlong_buffer | lora_r | reset |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        rows.append(
            f"| {phase.name} | {phase.max_steps} | {phase.temperature:g} | {phase.top_p:g} | {phase.num_generations} "
            f"| {phase.max_completion_length} | {phase.overlong_buffer} | {phase.lora_r or '-'} "
            f"| {'yes' if phase.hard_reset else '-'} |"
        )
    return rows
