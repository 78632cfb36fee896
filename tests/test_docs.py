"""The docs cannot drift: every Python snippet runs, every CLI line parses, every relative link resolves.

For each page of `docs/*.md` and `README.md`:
- the ```python blocks run in order, in one namespace per page, in a temporary folder (on the tiny model; a block
  with `<!-- not-run: why -->` right above it is skipped). They run in this process with `exec`: the text is our own
  docs, and one process shares the torch/TRL import across pages, which keeps the whole test near a minute on 2 cores.
- the CLI lines in ```bash blocks (`prorl-trl ...`, `python -m prorl_trl ...`, `accelerate launch ... -m prorl_trl
  ...`, `trl grpo ... rewards.X`) are checked by what they are: `train` and `validate` lines run as
  `prorl-trl validate ... --no-machine-checks` (the recipe, its overrides and the batch arithmetic must pass; a
  `train --resume CHECKPOINT` path is dropped, as no run exists here), `ablate` lines with `--validate-only
  --no-machine-checks`, and the other subcommands with `--help`, checking that every `--option` the line uses is one
  the subcommand lists. `accelerate launch` lines must name an existing `--config_file`.
- every relative link `[text](path)` resolves to an existing file or folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md")) + [README]
PAGE_IDS = [str(page.relative_to(REPO)) for page in PAGES]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run\b[^>]*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
RECIPE_COMMANDS = {"train", "validate"}


def blocks(page: Path, language: str) -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) of each fenced block of `language`."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) != language:
            continue
        before = text[: match.start()].rstrip("\n").splitlines()
        skipped = bool(before) and bool(NOT_RUN.search(before[-1]))
        found.append((text.count("\n", 0, match.start()) + 1, match.group(2), skipped))
    return found


def test_every_page_is_found():
    names = {page.name for page in PAGES}
    for name in ("index.md", "quickstart.md", "recipes-and-cli.md", "trainer-api.md", "rewards.md", "evaluation.md",
                 "distillation.md", "ablations.md", "resume-and-preemption.md", "scale-out.md", "performance.md",
                 "troubleshooting.md", "seed-practice.md"):  # fmt: skip
        assert name in names, f"docs/{name} is missing"


# --- Python snippets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_snippets_run(page, tmp_path, monkeypatch):
    snippets = [(line, code) for line, code, skipped in blocks(page, "python") if not skipped]
    if not snippets:
        pytest.skip("no runnable Python snippet")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from rewards import registry

    # a snippet that registers a reward must not leave it for later tests (the registry is process-wide)
    monkeypatch.setattr(registry, "_USER_REWARDS", dict(registry._USER_REWARDS))
    namespace: dict = {"__name__": "__docs__"}
    for line, code in snippets:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # our own docs' text
        except Exception as error:
            raise AssertionError(f"{page.relative_to(REPO)}, the ```python block at line {line} fails: {error!r}")


# --- CLI lines ---------------------------------------------------------------------------------------------------


def cli_lines(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, tokens) of every command in ```bash blocks, `\\` continuations joined, `&&` chains split."""
    commands = []
    for start, code, skipped in blocks(page, "bash"):
        if skipped:
            continue
        joined = re.sub(r"\\\n\s*", " ", code)
        for offset, line in enumerate(joined.splitlines()):
            for part in line.split("&&"):
                tokens = shlex.split(part, comments=True)
                if tokens:
                    commands.append((start + 1 + offset, tokens))
    return commands


def prorl_arguments(tokens: list[str]) -> list[str] | None:
    """The `prorl-trl` arguments of a command line, or None when it is not a prorl-trl command."""
    env_free = tokens[next((i for i, t in enumerate(tokens) if "=" not in t or t.startswith("-")), len(tokens)) :]
    if env_free[:1] == ["prorl-trl"]:
        return env_free[1:]
    if env_free[:3] == ["python", "-m", "prorl_trl"]:
        return env_free[3:]
    if env_free[:2] == ["accelerate", "launch"] and "prorl_trl" in env_free:
        position = env_free.index("prorl_trl")
        assert env_free[position - 1] == "-m", f"expected `-m prorl_trl` in {shlex.join(tokens)}"
        launcher = env_free[2 : position - 1]
        if "--config_file" in launcher:
            config = REPO / launcher[launcher.index("--config_file") + 1]
            assert config.is_file(), f"{shlex.join(tokens)}: no launch config {config}"
        return env_free[position + 1 :]
    return None


def absolute(arguments: list[str]) -> list[str]:
    """Repository paths made absolute, so the command can run from a temporary folder."""
    return [str(REPO / a) if not a.startswith("-") and "/" in a and (REPO / a).exists() else a for a in arguments]


def as_check(arguments: list[str]) -> list[str]:
    """The command that checks a documented command without running it."""
    command, rest = arguments[0], list(arguments[1:])
    if command in RECIPE_COMMANDS:
        if "--resume" in rest:  # `--resume CHECKPOINT`: no run exists here; keep the flag, drop the path
            position = rest.index("--resume")
            if position + 1 < len(rest) and not rest[position + 1].startswith("-") and position > 0:
                del rest[position + 1]
        return ["validate", *absolute(rest), *([] if "--no-machine-checks" in rest else ["--no-machine-checks"])]
    if command == "ablate":
        extra = [flag for flag in ("--validate-only", "--no-machine-checks") if flag not in rest]
        return ["ablate", *absolute(rest), *extra]
    return [command, "--help"]


def run_cli(arguments: list[str]) -> tuple[int, str]:
    from prorl_trl.cli import main

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            status = main(arguments)
        except SystemExit as exit:  # argparse's --help
            status = exit.code or 0
    return int(status), output.getvalue()


def option_names(help_text: str) -> set[str]:
    return {name.replace("_", "-") for name in re.findall(r"(--[A-Za-z][\w-]*)", help_text)}


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_cli_lines_parse(page, tmp_path, monkeypatch):
    commands = cli_lines(page)
    checked = 0
    monkeypatch.chdir(tmp_path)
    for line, tokens in commands:
        where = f"{page.relative_to(REPO)}:{line}: {shlex.join(tokens)}"
        if tokens[:2] == ["trl", "grpo"]:  # reward dotted paths must import
            import rewards

            for token in tokens:
                if token.startswith("rewards."):
                    assert hasattr(rewards, token.split(".", 1)[1]), f"{where}: no {token}"
            checked += 1
            continue
        arguments = prorl_arguments(tokens)
        if arguments is None:
            continue
        assert arguments, f"{where}: no subcommand"
        check = as_check(arguments)
        status, output = run_cli(check)
        assert status == 0, f"{where}\nchecked as: prorl-trl {shlex.join(check)}\nexit {status}:\n{output[-3000:]}"
        if check[-1] == "--help":
            known = option_names(output)
            used = {a.split("=", 1)[0].replace("_", "-") for a in arguments[1:] if a.startswith("--")}
            unknown = sorted(used - known - {"--help"})
            assert not unknown, f"{where}: `prorl-trl {arguments[0]}` has no option {unknown}"
        checked += 1
    if not checked:
        pytest.skip("no CLI line")


def test_the_trl_grpo_line_trains(tiny_dir, tmp_path):
    """docs/rewards.md's `trl grpo` block runs as written (its dataset line, then TRL's own CLI with our rewards),
    with the tiny model in place of the hub one and a one-step budget: a line that only parses let a dataset without
    a `prompt` column through."""
    (start, code, _), *_ = [block for block in blocks(REPO / "docs" / "rewards.md", "bash") if "trl grpo" in block[1]]
    quick = (f" --model_name_or_path {tiny_dir} --max_steps 1 --per_device_train_batch_size 4 --num_generations 4"
             " --max_completion_length 8 --use_cpu --report_to none --save_strategy no")  # fmt: skip
    script = "\n".join(line + quick if line.startswith("trl grpo") else line for line in code.splitlines())
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=environment,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"docs/rewards.md:{start}:\n{done.stderr[-3000:]}"
    assert "rewards/math_equivalence/mean" in done.stdout + done.stderr


def test_the_seed_practice_example_runs(tiny_dir, tmp_path):
    """docs/seed-practice.md's worked example runs as written, with the tiny model in place of the demo's warm start
    (and no validation): a finished run extended in its last phase, then by an appended phase, leaves what the page
    says: the earlier `final/` kept as `final-phase1-step4/`, a new `final/`, both extensions in resume_history.yaml,
    one log on one step axis."""
    import json

    import yaml

    (start, code, _), *_ = [b for b in blocks(REPO / "docs" / "seed-practice.md", "bash") if "--allow-changes" in b[1]]
    quick = f" --model.name_or_path {tiny_dir} --validation.enabled false"
    script = "\n".join(line + quick if line.startswith("prorl-trl train") else line for line in code.splitlines())
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=environment,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, f"docs/seed-practice.md:{start}:\n{done.stderr[-3000:]}"
    run = tmp_path / "seed-like"
    assert (run / "final-phase1-step4" / "config.json").is_file() and (run / "final" / "config.json").is_file()
    history = yaml.safe_load((run / "resume_history.yaml").read_text())
    assert "extended" in json.dumps(history), history
    steps = [entry["step"] for entry in json.loads((run / "prorl_log_history.json").read_text())]
    assert steps == sorted(steps) and steps[-1] == 8, steps  # one step axis, 2 + 4 + 2 steps


# --- links -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # links inside code blocks are code, not links
    broken = []
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):  # an anchor, http(s):, mailto:
            continue
        if not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


def test_figures_link_to_their_results():
    """Performance pages cite their measurements: each names at least one benchmarks/results file."""
    for name in ("performance.md", "seed-run.md", "scale-out.md", "resume-and-preemption.md"):
        text = (REPO / "docs" / name).read_text(encoding="utf-8")
        assert "../benchmarks/results/" in text, f"docs/{name} links no benchmarks/results file"


def test_environment_is_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
