"""A real prolonged run on one GPU, end to end, launched exactly as the README says; killed, resumed, checked.

    python benchmarks/e2e_gpu.py --out benchmarks/results/e2e.md     # GPU: Qwen2-0.5B architecture, < 10 minutes
    python benchmarks/e2e_gpu.py --smoke                             # CPU, tiny model: checks the script runs

1. Saves a model to disk: the Qwen2-0.5B architecture with random weights (bf16) and a byte-level BPE tokenizer of
   Qwen2's vocabulary size built in-process (nothing is downloaded), plus a slice of the local GSM8K files.
2. Runs `accelerate launch --config_file recipes/accelerate/single_gpu.yaml -m prorl_trl train
   recipes/prorl_gsm8k_qwen2_0.5b.yaml` with overrides that only shorten it: every phase 3 steps, shorter caps,
   8 validation problems every 2 steps, a checkpoint every 2 steps; every phase, every reset, validation,
   checkpointing and `report_to: tensorboard` stay.
3. Kills the run with SIGKILL (launcher and trainer) in the middle of phase 2 (after reset 1), as soon as that
   phase's first checkpoint is complete, then runs the same command with `--resume`.
4. Checks: the run ends in the last phase with one reset per phase boundary, `final/` loads with `from_pretrained`
   and generates, the TensorBoard events hold every phase at continuous steps. Prints one table: wall time per
   phase (from the trainer's phase banners), the kill, the resume, and each check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import DEFAULT_RECIPE, ROOT, device_name, publish, utc_now, versions  # first

LAUNCH_CONFIG = ROOT / "recipes" / "accelerate" / "single_gpu.yaml"
NUM_PHASES = 5
KILL_PHASE = 1  # the phase after reset 1 ("reset-1")
BANNER = re.compile(r"ProRL phase (\d+)/(\d+) '")
ENDED = re.compile(r"ProRL phase '([^']+)' ended after (\d+) steps")


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `Qwen2Tokenizer` with `vocab_size` tokens: the tiny tokenizer's byte alphabet and chat
    special tokens (prorl_trl.tiny), then merges of every byte pair, then of printable pairs with one more character,
    until the vocabulary has Qwen2's size. Real-size embedding and LM head, real BPE work per token."""
    from transformers import Qwen2Tokenizer

    from prorl_trl.tiny import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, tiny_vocab

    vocab = tiny_vocab()
    symbols = [token for token in vocab if token not in (PAD_TOKEN, EOS_TOKEN, *CHAT_SPECIAL_TOKENS)]
    printable = [symbol for symbol in symbols if symbol.isprintable()][:95]
    merges = []
    candidates = [(a, b) for a in symbols for b in symbols]
    candidates += [(a + b, c) for a in printable for b in printable for c in printable]
    for left, right in candidates:
        if len(vocab) >= vocab_size:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=CHAT_SPECIAL_TOKENS,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_model(path: Path, smoke: bool) -> tuple[Path, int]:
    """The model folder the recipe loads by path; returns (path, parameter count)."""
    import torch

    from prorl_trl.tiny import build_tiny_model

    tokenizer = build_tokenizer(2048 if smoke else 151_643)
    if smoke:
        model = build_tiny_model(tokenizer, seed=0)
    else:
        from transformers import Qwen2ForCausalLM

        from generation import qwen2_05b_config

        config = qwen2_05b_config()
        config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = config.pad_token_id, config.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def copy_gsm8k(source: Path, target: Path, train_rows: int, test_rows: int) -> Path:
    """The first rows of the local GSM8K files (`<split>.jsonl`, the layout the gsm8k builder reads)."""
    target.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("test", test_rows)):
        with open(source / f"{split}.jsonl") as src, open(target / f"{split}.jsonl", "w") as dst:
            for _, line in zip(range(rows), src):
                dst.write(line)
    return target


def overrides(model: Path, data: Path, out: Path, smoke: bool) -> list[str]:
    """Shorten the recipe, keep its structure (5 phases, 4 resets, validation, checkpoints, tensorboard)."""
    cap, last_cap, buffer = (8, 12, 4) if smoke else (96, 128, 32)
    shortened = [token for i in range(NUM_PHASES) for token in (f"--phases.{i}.max_steps", "3")]
    shortened += [
        "--model.name_or_path", str(model), "--data.source", str(data), "--training.output_dir", str(out),
        "--data.validation_size", "8", "--validation.eval_steps", "2", "--validation.max_completion_length", str(cap),
        "--training.save_steps", "2", "--training.max_completion_length", str(cap),
        "--phases.4.max_completion_length", str(last_cap), "--phases.4.overlong_buffer", str(buffer),
        "--training.generation_max_prompt_length", "512",
    ]  # fmt: skip
    if smoke:  # the recipe's batch shape (16 x 2 accumulation, 16 generations) is for a GPU
        shortened += [
            "--training.bf16", "false", "--model.dtype", "float32", "--training.per_device_train_batch_size", "4",
            "--training.gradient_accumulation_steps", "1", "--training.num_generations", "4",
            "--training.generation_batch_size", "8", "--phases.4.num_generations", "8", "--validation.batch_size", "8",
            "--peft.r", "4", "--phases.4.lora_r", "8", "--phases.4.lora_alpha", "16",
        ]  # fmt: skip
    return shortened


class Launch:
    """One `accelerate launch ... train` process group; output lines are kept with their arrival time."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path):
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.wait()
        self.reader.join(timeout=10)
        self.log.close()
        return code


def phase_times(lines: list[tuple[float, str]]) -> dict[int, list[float]]:
    """Phase index -> [start, end] wall clock, from the trainer's banners ("ProRL phase k/N ...", "... ended")."""
    spans: dict[int, list[float]] = {}
    current = None
    for stamp, line in lines:
        if match := BANNER.search(line):
            current = int(match.group(1)) - 1
            spans.setdefault(current, [stamp, stamp])
        elif ENDED.search(line) and current is not None:
            spans[current][1] = stamp
    return spans


def tensorboard_phases(run: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of `train/prorl/phase` and `train/prorl/phase_start` from every event file of the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {"train/prorl/phase": [], "train/prorl/phase_start": []}
    for folder in sorted({p.parent for p in (run / "runs").rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in found:
            if tag in events.Tags()["scalars"]:
                found[tag] += [(e.step, e.value) for e in events.Scalars(tag)]
    return found


def load_final(path: Path, smoke: bool) -> str:
    """`from_pretrained` on `final/` and one greedy generation; returns a description."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cpu" if smoke else "cuda"
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Natalia sold clips to 48 of her friends.", return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    return f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {model.dtype}, generated {out.shape[1] - ids['input_ids'].shape[1]} tokens"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and tokenizer, tiny batches.")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k", help="GSM8K folder")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and the run go (default: temp)")
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock limit for both processes together")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --smoke for the CPU check.")
    started = time.time()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="prorl-e2e-"))
    shutil.rmtree(workdir / "run", ignore_errors=True)
    model, num_params = save_model(workdir / "model", args.smoke)
    data = copy_gsm8k(args.data, workdir / "gsm8k", train_rows=256, test_rows=16)
    prepared = time.time() - started
    run = workdir / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_CONFIG)]
    command += ["--cpu"] if args.smoke else []
    command += ["-m", "prorl_trl", "train", str(DEFAULT_RECIPE), *overrides(model, data, run, args.smoke)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"

    # First process: killed as soon as the killed phase's first checkpoint is complete (it is then in its next step).
    marker = run / f"phase-{KILL_PHASE}" / "checkpoint-2" / "prorl_state.json"
    first = Launch(command, env, workdir / "first.log")
    deadline = started + args.budget_s
    while not marker.exists() and first.process.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    killed_at = time.time()
    was_running = first.process.poll() is None
    first.kill() if was_running else None
    first.wait(timeout=30)
    killed = was_running and marker.exists()

    second = Launch(command + ["--resume"], env, workdir / "second.log")
    code = second.wait(timeout=max(deadline - time.time(), 30))
    resumed_line = next((line for _, line in second.lines if "resuming from" in line), "")
    total = time.time() - started

    checks = {}
    state_file = run / "final" / "prorl_state.json"
    final_state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    checks["killed mid-phase after reset 1 (SIGKILL)"] = killed
    checks["resumed from a checkpoint of the killed phase"] = f"phase-{KILL_PHASE}/checkpoint-" in resumed_line
    checks["resumed run exit status 0"] = code == 0
    checks[f"ended in the last phase with {NUM_PHASES - 1} resets"] = (
        final_state.get("resets") == NUM_PHASES - 1 and final_state.get("last_phase") == "reset-4"
    )
    try:
        checks["final/ loads with from_pretrained"] = load_final(run / "final", args.smoke)
    except Exception as error:  # reported in the table, not raised: the table is the result
        checks["final/ loads with from_pretrained"] = f"**no**: {type(error).__name__}: {error}"
    try:
        events = tensorboard_phases(run)
        phases_seen = sorted({int(v) for _, v in events["train/prorl/phase"]})
        starts = sorted({(s, int(v)) for s, v in events["train/prorl/phase_start"]})
        checks["TensorBoard events hold every phase"] = phases_seen == list(range(NUM_PHASES)) and len(starts) == NUM_PHASES
        checks["TensorBoard phase starts (step, phase)"] = ", ".join(f"({s}, {p})" for s, p in starts)
    except Exception as error:
        checks["TensorBoard events hold every phase"] = f"**no**: {type(error).__name__}: {error}"

    spans_first, spans_second = phase_times(first.lines), phase_times(second.lines)
    rows = []
    for index in range(NUM_PHASES):
        span = spans_second.get(index) or spans_first.get(index)
        note = ""
        if index == KILL_PHASE:
            note = "killed after its checkpoint 2, resumed in a new process (time from the resumed banner)"
        rows.append((f"phase {index + 1} ({['initial', 'reset-1', 'reset-2', 'reset-3', 'reset-4'][index]})",
                     f"{span[1] - span[0]:.1f}" if span else "n/a", note))  # fmt: skip
    first_start = min((s[0] for s in spans_first.values()), default=None)
    second_start = min((s[0] for s in spans_second.values()), default=None)
    device = "CPU (smoke)" if args.smoke else device_name()
    lines = [
        f"# End-to-end GSM8K recipe run, killed and resumed ({device}, {utc_now()})",
        "",
        f"`accelerate launch --config_file recipes/accelerate/single_gpu.yaml -m prorl_trl train "
        f"recipes/prorl_gsm8k_qwen2_0.5b.yaml` + shortening overrides; model: "
        f"{'tiny Qwen2' if args.smoke else 'Qwen2-0.5B architecture, random init, bf16'} ({num_params / 1e6:.0f}M "
        f"params), BPE tokenizer of {'2,048' if args.smoke else '151,643'} tokens; {versions('torch', 'transformers', 'trl')}, "
        f"Python {platform.python_version()}.",
        "",
        "| what | seconds | note |",
        "| --- | --- | --- |",
        f"| model + tokenizer + data written | {prepared:.1f} | |",
        f"| first process: launch to phase 1 banner | {first_start - started - prepared:.1f} | imports, model load, data |"
        if first_start else "| first process start | n/a | |",
        *[f"| {name} | {seconds} | {note} |" for name, seconds, note in rows],
        f"| kill to resumed phase banner | {second_start - killed_at:.1f} | new process: imports, load, restore |"
        if second_start else "| resume | n/a | |",
        f"| total (both processes) | {total:.1f} | |",
        "",
        "| check | result |",
        "| --- | --- |",
        *[f"| {name} | {_fmt(value)} |" for name, value in checks.items()],
    ]
    table = "\n".join(lines)
    publish(table, args.out)
    return table


def _fmt(value) -> str:
    return {True: "yes", False: "**no**"}.get(value, str(value)) if isinstance(value, bool) else str(value)


if __name__ == "__main__":
    main()
