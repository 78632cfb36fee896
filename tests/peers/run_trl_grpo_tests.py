"""Run TRL's own `tests/test_grpo_trainer.py` twice, with `GRPOTrainer` and with `ProRLTrainer` substituted, offline.

Differential test against the peer: every test that passes with TRL's trainer must pass with ProRLTrainer /
ProRLConfig in its place (a one-phase ProRL run is a GRPOTrainer run), and every difference is explained in
`tests/peers/trl_grpo_tests.md`. Nothing of TRL's test code is copied into this repository: the file is read from a
TRL checkout at run time (`fetch` gives one under /work/.mirror), rewritten in a work folder, and run there.

What the rewrite changes, identically for both runs (so only the trainer class differs between them):
* `from trl import GRPOConfig, GRPOTrainer` -> ProRLConfig / ProRLTrainer under those names (ProRL run only);
* hub model ids -> tiny local models built by `prorl_trl.tiny` (Qwen2 and Qwen3, causal LM and one-label
  sequence classifier, with the tiny byte-level tokenizer); other architectures have no substitute and error out in
  both runs;
* `load_dataset("trl-internal-testing/zen", ...)` -> an in-memory stand-in: the 19 lines of the Zen of Python
  (`import this`), 17 train / 2 test, as `prompt` strings or user messages, map-style or streaming;
* TRL's default `bf16=True` is refused by TrainingArguments on a machine without a bf16 GPU, so the hardware probe
  `is_torch_bf16_gpu_available` reports True (CPU autocast) in both runs;
* `testing_utils.is_joblib_available` (gone from trl 1.16's import_utils) is defined as False.

Usage: python tests/peers/run_trl_grpo_tests.py [--trl-repo DIR] [--rev REV] [--work DIR] [-k EXPR] [--only grpo|prorl]
       [--prorl-root DIR]  (another prorl-trl tree, e.g. `git archive main` unpacked, to compare before/after)
Prints one table (test, GRPOTrainer outcome, ProRLTrainer outcome) and writes it to <work>/results.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRL_TESTS = ("tests/test_grpo_trainer.py", "tests/testing_utils.py")
# Hub model id -> (architecture of the tiny stand-in, task).
MODEL_SUBSTITUTES = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "reward"),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", "reward"),
}

SUBSTITUTES_MODULE = '''"""Offline stand-ins for the hub data set `trl-internal-testing/zen` (written by run_trl_grpo_tests.py)."""
import contextlib
import io

from datasets import Dataset, DatasetDict, IterableDatasetDict


def _zen_lines():
    with contextlib.redirect_stdout(io.StringIO()) as text:
        import this  # noqa: F401  (prints the Zen of Python once per process)
    lines = [line for line in text.getvalue().splitlines()[2:] if line.strip()]
    if not lines:  # already imported in this process: decode it again
        import codecs
        import this
        lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]
    return lines


def _split(lines, conversational):
    prompts = [" ".join(line.split()[: max(2, len(line.split()) // 2)]) for line in lines]
    if conversational:
        prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    return Dataset.from_dict({"prompt": prompts})


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    if path != "trl-internal-testing/zen" or name not in ("standard_prompt_only", "conversational_prompt_only"):
        raise FileNotFoundError(f"no offline stand-in for {path} / {name}")
    lines = _zen_lines()
    conversational = name == "conversational_prompt_only"
    splits = {"train": _split(lines[:17], conversational), "test": _split(lines[17:19], conversational)}
    if streaming:
        splits = {key: value.to_iterable_dataset() for key, value in splits.items()}
        return splits[split] if split else IterableDatasetDict(splits)
    return splits[split] if split else DatasetDict(splits)
'''

CONFTEST = '''"""Offline, CPU: both runs see the same environment (written by run_trl_grpo_tests.py)."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import transformers.training_args  # noqa: E402

# TRL's default config is bf16; on a CPU-only machine TrainingArguments refuses it unless this probe says yes.
transformers.training_args.is_torch_bf16_gpu_available = lambda: True
'''


def build_models(folder: Path) -> dict[str, str]:
    """Save the tiny stand-ins once; returns hub id -> local path."""
    import torch
    from transformers import Qwen2ForSequenceClassification, Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config

    paths = {}
    for hub_id, (architecture, task) in MODEL_SUBSTITUTES.items():
        path = folder / hub_id.split("/")[-1]
        paths[hub_id] = str(path)
        if (path / "config.json").is_file():
            continue
        tokenizer = build_tiny_tokenizer()
        config = tiny_config(tokenizer)
        if architecture == "qwen3":
            config = Qwen3Config(**{k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")})
        torch.manual_seed(0)
        if task == "reward":
            config.num_labels = 1
            model = (Qwen2ForSequenceClassification if architecture == "qwen2" else Qwen3ForSequenceClassification)(config)
        elif architecture == "qwen2":
            model = build_tiny_model(tokenizer)
        else:
            model = Qwen3ForCausalLM(config)
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def rewrite(source: str, models: dict[str, str], trainer: str) -> str:
    for hub_id, path in models.items():
        source = source.replace(f'"{hub_id}"', repr(path))
    source = source.replace("\nif is_peft_available():", "\nfrom ._substitutes import load_dataset  # offline zen\n\nif is_peft_available():", 1)
    if trainer == "prorl":
        source = source.replace(
            "from trl import GRPOConfig, GRPOTrainer",
            "from prorl_trl import ProRLConfig as GRPOConfig, ProRLTrainer as GRPOTrainer",
        )
    return source


def prepare(work: Path, trl_repo: Path, rev: str, trainer: str) -> Path:
    package = work / f"trl_tests_{trainer}"
    package.mkdir(parents=True, exist_ok=True)
    models = build_models(work / "models")
    test, utils = (subprocess.run(["git", "-C", str(trl_repo), "show", f"{rev}:{name}"], capture_output=True, text=True,
                                  check=True).stdout for name in TRL_TESTS)
    utils = utils.replace("    is_joblib_available,\n", "") + "\n\ndef is_joblib_available():\n    return False\n"
    (package / "__init__.py").write_text("")
    (package / "conftest.py").write_text(CONFTEST)
    (package / "_substitutes.py").write_text(SUBSTITUTES_MODULE)
    (package / "testing_utils.py").write_text(utils)
    (package / "test_grpo_trainer.py").write_text(rewrite(test, models, trainer))
    return package


def run(package: Path, keyword: str | None, timeout: int, prorl_root: Path) -> dict[str, str]:
    report = package / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}",
               f"--junitxml={report}", "--rootdir", str(package.parent), str(package / "test_grpo_trainer.py")]
    if keyword:
        command += ["-k", keyword]
    env = {**os.environ, "PYTHONPATH": f"{prorl_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, cwd=package.parent, env=env, check=False)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        kinds = [child.tag for child in case]
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        if outcome == "skipped":
            message = case.find("skipped").get("message", "")
            outcome = "xfail" if "xfail" in (case.find("skipped").get("type", "") + message) else "skipped"
        if outcome in ("failure", "error"):
            detail = case.find(outcome)
            lines = (detail.get("message") or detail.text or "").strip().splitlines()
            first = re.sub(r"\s+", " ", lines[0] if lines else "")[:150]
            outcome = f"{outcome}: {first}"
        outcomes[name] = outcome
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-repo", type=Path, default=Path("/work/.mirror/huggingface+trl/repo"))
    parser.add_argument("--rev", default=None, help="default: tag v1.16.0 if the checkout has it, else HEAD")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl_grpo_tests"))
    parser.add_argument("-k", dest="keyword", default=None)
    parser.add_argument("--only", choices=("grpo", "prorl"), default=None)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--prorl-root", type=Path, default=REPO_ROOT, help="the prorl-trl tree to test (e.g. an export of main)")
    options = parser.parse_args()
    tags = subprocess.run(["git", "-C", str(options.trl_repo), "tag"], capture_output=True, text=True).stdout.split()
    rev = options.rev or ("v1.16.0" if "v1.16.0" in tags else "HEAD")
    results = {}
    for trainer in [options.only] if options.only else ["grpo", "prorl"]:
        package = prepare(options.work, options.trl_repo, rev, trainer)
        results[trainer] = run(package, options.keyword, options.timeout, options.prorl_root)
    names = sorted(set().union(*results.values()))
    rows = ["| test | GRPOTrainer | ProRLTrainer |", "| --- | --- | --- |"]
    rows += [f"| {n} | {results.get('grpo', {}).get(n, '-')} | {results.get('prorl', {}).get(n, '-')} |" for n in names]
    summary = {t: {o.split(':')[0]: sum(v.split(':')[0] == o.split(':')[0] for v in r.values()) for o in r.values()} for t, r in results.items()}
    table = "\n".join([f"TRL rev {rev}; outcomes per trainer: {summary}", "", *rows])
    (options.work / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
