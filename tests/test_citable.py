"""Numbers in the project's files are dated so a reader can look them up: a date and a commit, or a results file's
section. An ordinal of an internal work period (the word for a sitting of work after "fifth", "9th", "this", "next")
names nothing a reader can find, so no code, doc or results file may date anything that way."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|[0-9]+(?:st|nd|rd|th)"
)
RELATIVE = "this|that|next|last|previous|earlier|later|same|another"
WORK_PERIOD = re.compile(rf"\b(?:{ORDINALS}|{RELATIVE})[- ]" + "sess" + r"ions?\b", re.IGNORECASE)
FOLDERS = ("prorl_trl", "docs", "benchmarks", "recipes", "rewards", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".cfg", ".toml", ".sh"}
def project_files() -> list[Path]:
    files = [path for path in ROOT.glob("*.md")]
    for folder in FOLDERS:
        files += [path for path in (ROOT / folder).rglob("*") if path.suffix in SUFFIXES and path.is_file()]
    return sorted(files)


def test_the_pattern_finds_work_period_ordinals():
    period = "sess" + "ion"  # spelled in parts, so this file passes its own rule
    for dated in (f"the ninth {period}'s table", f"(Fifth {period}, H200)", f"in the 11th {period}", f"this {period}",
                  f"earlier {period}s", f"next {period}", f"that {period}'s call 3", f"the eighth {period}'s call 11"):
        assert WORK_PERIOD.search(dated), dated
    for legitimate in (f"start_new_{period}=True", f'scope="{period}"', f"in their own {period} (Ctrl-C)",
                       "2026-11-27, commit 115e9bb"):
        assert not WORK_PERIOD.search(legitimate), legitimate


def test_no_file_dates_a_number_by_a_work_period():
    found = []
    for path in project_files():
        relative = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if WORK_PERIOD.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "date these by a date and a commit (or a results file's section) instead:\n" + "\n".join(found)
