"""Two nodes simulated on one 2-GPU host (one GPU per "node") under DDP, ZeRO-3 and FSDP2: a hard reset, SIGTERM to
both nodes, relaunch with `--resume`, final weights vs a one-node run of the same global batch.

    python benchmarks/multi_node.py --out benchmarks/results/multi_node.md        # 2 GPUs, ~4-6 min
    python benchmarks/multi_node.py --smoke                                       # CPU: DDP over gloo only

Per engine (recipes/accelerate/multi_node.yaml for DDP, zero3.yaml, fsdp.yaml, each with `--num_processes 2`):
1. reference: one node, two GPUs (`--num_machines 1`, CUDA_VISIBLE_DEVICES=0,1);
2. two nodes: two `prorl-trl launch` processes, `--num_machines 2 --machine_rank 0/1 --main_process_ip 127.0.0.1
   --main_process_port P`, node r with CUDA_VISIBLE_DEVICES=r; two phases (LoRA r4 -> r2 with a hard reset between
   them, a checkpoint every step); once phase 2's first checkpoint is committed the driver sends SIGTERM to both
   nodes' launch processes, as SLURM's `--signal=TERM@N` would; both must exit 75 (interrupted, resumable) having
   stopped inside phase 2;
3. the same two commands with `--resume`: both exit 0;
4. final/model.safetensors of 3 vs 1: max |difference| over all tensors and how many tensors differ.
Expected: bitwise equal under all three. Both layouts give global rank r the same GPU, the same data and seed, and
the resume restores weights (or shards), optimizer state, RNG and sampler as saved; the "nodes" reach each other
through NCCL's shared-memory/socket transports instead of NVLink, but a reduction over two ranks has two summands,
and a + b == b + a in floating point, so the transport cannot change a bit. Across real machines with more ranks per
reduction NCCL may sum in another order: differences at the level of the reduction dtype's rounding are then
expected (this benchmark does not show that case).

The engines run side by side (each case's processes share the two GPUs with the other engines': the model is tiny)
to fit the device budget; `--serial` runs them one after another. The model is prorl_trl.tiny's (hidden 128,
2 layers) saved in the work folder, the data the built-in synthetic arithmetic task, the reward `token_parity`
registered by this file (deterministic, varies inside every group of a random model, so every step moves the
weights): this file is also the launcher (`launch ...`) and the training processes' script (`train ...`).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT, device_name, publish  # first: the repository on sys.path

CONFIGS = {"ddp": "multi_node.yaml", "zero3": "zero3.yaml", "fsdp2": "fsdp.yaml"}
EXPECTED = {
    "ddp": "bitwise",
    "zero3": "bitwise on one host",
    "fsdp2": "bitwise on one host",
}
INTERRUPTED = 75

RECIPE = """\
description: benchmarks/multi_node.py - tiny Qwen2, synthetic arithmetic, 2 phases with a LoRA reshape + hard reset
model:
  name_or_path: {model}
  dtype: float32
  attn_implementation: eager   # deterministic backward (SDPA's memory-efficient kernel uses atomics)
peft:
  r: 4
  lora_alpha: 8
  target_modules: [q_proj, v_proj]
data:
  builder: synthetic_arithmetic
  prompt_format: plain
  options: {{num_train: 256, num_validation: 8, seed: 0, num_steps: 1, max_value: 9, style: expression}}
rewards:
  - name: token_parity
training:
  output_dir: unused
  learning_rate: 1.0e-3
  per_device_train_batch_size: 4
  num_generations: 4
  max_completion_length: 8
  report_to: none
  logging_steps: 1
  save_strategy: steps
  save_steps: 1
  seed: 0
phases:
  - name: first
    max_steps: 3
  - name: second
    max_steps: 6
    temperature: 1.2
    lora_r: 2
    lora_alpha: 4
"""


def token_parity(completions, **kwargs):
    """A reward with a spread inside every group of a random model: the completion's characters, summed, mod 11."""
    return [(sum(map(ord, str(text))) % 11) / 11 for text in completions]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_command(
    config: str,
    recipe: Path,
    out: Path,
    machines: int,
    rank: int,
    port: int,
    smoke: bool,
) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / config), "--num_processes", "2", "--num_machines", str(machines),
               "--main_process_port", str(port)]  # fmt: skip
    if machines > 1:
        command += ["--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
    if smoke:
        command += ["--mixed_precision", "no"]
    command += ["train", str(recipe), "--training.output_dir", str(out)]
    return command + (["--training.use_cpu", "true"] if smoke else [])


def start(command: list[str], devices: str, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": devices,
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as output:
        output.write("$ CUDA_VISIBLE_DEVICES=" + devices + " " + " ".join(command) + "\n")
        output.flush()
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)


def two_nodes(
    config: str,
    recipe: Path,
    out: Path,
    log: Path,
    smoke: bool,
    stop_after: Path | None,
) -> list[int]:
    """Both nodes of one run; with `stop_after`, SIGTERM to both launch processes once that file exists."""
    port = free_port()
    nodes = [
        start(node_command(config, recipe, out, 2, rank, port, smoke) + (["--resume"] if stop_after is None else []),
              "" if smoke else str(rank), log.with_suffix(f".node{rank}.log"))
        for rank in (0, 1)
    ]  # fmt: skip
    if stop_after is not None:
        while not stop_after.is_file() and all(node.poll() is None for node in nodes):
            time.sleep(0.05)
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
    return [node.wait(timeout=900) for node in nodes]


def compare(reference: Path, out: Path, initial: bool = False) -> tuple[float, int, int]:
    """(max |difference|, tensors that differ, tensors) of two runs' final weights (`initial`: `reference` is the
    starting model's folder)."""
    from safetensors.torch import load_file

    want = load_file(reference / ("" if initial else "final") / "model.safetensors")
    got = load_file(out / "final" / "model.safetensors")
    assert want.keys() == got.keys(), "the two runs saved different tensors"
    diffs = {name: (want[name].float() - got[name].float()).abs().max().item() for name in want}
    return (
        max(diffs.values()),
        sum(not want[name].equal(got[name]) for name in want),
        len(want),
    )


def run_case(engine: str, work: Path, model: Path, smoke: bool) -> dict:
    """One engine: reference, interrupted two-node run, resumed two-node run, comparison. A row of the table."""
    import json

    config, case = CONFIGS[engine], work / engine
    case.mkdir(parents=True, exist_ok=True)
    recipe = case / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=model))
    row: dict = {"engine": engine, "config": config}
    started = time.time()
    reference = start(node_command(config, recipe, case / "reference", 1, 0, free_port(), smoke), "" if smoke else "0,1",
                      case / "reference.log").wait(timeout=900)  # fmt: skip
    row["reference"] = reference
    if reference != 0:
        return {
            **row,
            "verdict": f"FAIL: the reference run failed ({case / 'reference.log'})",
        }
    out = case / "two-nodes"
    row["stopped"] = two_nodes(
        config,
        recipe,
        out,
        case / "stop",
        smoke,
        out / "phase-1" / "checkpoint-1" / "prorl_state.json",
    )
    checkpoints = sorted(out.glob("phase-*/checkpoint-*/prorl_state.json"))
    last = json.loads(checkpoints[-1].read_text()) if checkpoints else {}
    row["stop_at"] = (
        f"phase {last.get('phase_index', 0) + 1}, step {last.get('global_step')}, resets {last.get('resets')}"
    )
    row["resumed"] = two_nodes(config, recipe, out, case / "resume", smoke, None)
    row["seconds"] = round(time.time() - started)
    if row["stopped"] != [INTERRUPTED, INTERRUPTED] or last.get("phase_index") != 1:
        return {
            **row,
            "verdict": f"FAIL: the stop did not end as interrupted-resumable in phase 2 ({case}/stop.*.log)",
        }
    if row["resumed"] != [0, 0]:
        return {**row, "verdict": f"FAIL: the resume failed ({case}/resume.*.log)"}
    final = json.loads((out / "final" / "prorl_state.json").read_text())
    row["final"] = f"step {final.get('global_step')}, resets {final.get('resets')}"
    row["max_abs_diff"], row["differing"], row["tensors"] = compare(case / "reference", out)
    row["moved"] = compare(model, case / "reference", initial=True)[0]  # not a comparison of untrained runs
    equal = row["differing"] == 0
    row["verdict"] = "PASS (bitwise)" if equal else "FAIL (expected bitwise)"
    return row


def table(rows: list[dict], header: str) -> str:
    columns = [
        ("engine (config)", lambda r: f"{r['engine']} (`{r['config']}`)"),
        ("reference: 1 node x 2, exit", lambda r: r.get("reference", "-")),
        ("SIGTERM both nodes: exit", lambda r: r.get("stopped", "-")),
        ("last checkpoint after the stop", lambda r: r.get("stop_at", "-")),
        ("resume: exit", lambda r: r.get("resumed", "-")),
        ("final", lambda r: r.get("final", "-")),
        (
            "max abs diff vs 1 node",
            lambda r: f"{r['max_abs_diff']:.3g}" if "max_abs_diff" in r else "-",
        ),
        (
            "tensors differing",
            lambda r: f"{r['differing']}/{r['tensors']}" if "differing" in r else "-",
        ),
        ("1-node run moved from init (max abs)", lambda r: f"{r['moved']:.3g}" if "moved" in r else "-"),
        ("expected", lambda r: EXPECTED[r["engine"]]),
        ("verdict", lambda r: r["verdict"]),
        ("s", lambda r: r.get("seconds", "-")),
    ]
    lines = [
        header,
        "",
        "| " + " | ".join(name for name, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(cell(r)) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    import torch

    from prorl_trl.tiny import save_tiny

    engines = ["ddp"] if args.smoke else args.engines.split(",")
    if not args.smoke and torch.cuda.device_count() < 2:
        print(
            f"needs 2 GPUs, found {torch.cuda.device_count()} (use --smoke on CPU)",
            file=sys.stderr,
        )
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="multi_node_"))
    model = save_tiny(work / "tiny", hidden_size=128, num_hidden_layers=2)
    rows: dict[str, dict] = {}
    started = time.time()

    def one(engine: str) -> None:
        try:
            rows[engine] = run_case(engine, work, model, args.smoke)
        except Exception as error:  # noqa: BLE001 - reported in the table
            rows[engine] = {
                "engine": engine,
                "config": CONFIGS[engine],
                "verdict": f"error: {error!r}"[:300],
            }
        print(f"[{engine}] {rows[engine]['verdict']}", flush=True)

    threads = [threading.Thread(target=one, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
        if args.serial:
            thread.join()
    for thread in threads:
        thread.join()
    device = "CPU (gloo)" if args.smoke else f"2 x {device_name()}"
    header = (
        f"# Two simulated nodes vs one node ({device}; {time.time() - started:.0f} s in all)\n\n"
        f"`python benchmarks/multi_node.py{' --smoke' if args.smoke else ''}`: per engine, a one-node 2-process run, "
        "then 2 nodes x 1 process (`prorl-trl launch --num_machines 2 --machine_rank 0/1 --main_process_ip "
        "127.0.0.1`, one GPU each) with a hard reset (LoRA r4 -> r2) after 3 steps, SIGTERM to both nodes once "
        "phase 2's first checkpoint is committed, and a relaunch of both with `--resume`; final/model.safetensors "
        f"compared with the one-node run's. Logs: {work}/<engine>/."
    )
    publish(table([rows[e] for e in engines], header), args.out)
    return 0 if all(rows[e]["verdict"].startswith("PASS") for e in engines) else 1


def as_cli(argv: list[str]) -> int:
    """`launch ...` (the launch process: its training processes run this file) or `train ...` (a training process):
    prorl-trl's CLI with the `token_parity` reward registered."""
    import prorl_trl.launch
    import rewards
    from prorl_trl.cli import main

    rewards.register("token_parity")(token_parity)
    prorl_trl.launch.TRAINING_SCRIPT = [str(Path(__file__).resolve())]
    return main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] in (["launch"], ["train"]):
        sys.exit(as_cli(sys.argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: DDP over gloo only")
    parser.add_argument("--engines", default="ddp,zero3,fsdp2", help="comma list of ddp, zero3, fsdp2")
    parser.add_argument(
        "--serial",
        action="store_true",
        help="one engine after another (default: side by side)",
    )
    parser.add_argument("--workdir", default=None, help="work folder (default: a new temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    sys.exit(driver(parser.parse_args()))
