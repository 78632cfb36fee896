"""What each generation path keeps allocated between generations, i.e. beside the training step; prints one table.

    python benchmarks/generation_memory.py                 # one GPU: reset-3 and reset-4 shapes, both paths
    python benchmarks/generation_memory.py --smoke         # CPU: checks the script runs (no CUDA memory to read)

Why: `benchmarks/memory.py` shows the trainer's peak with the rollout engine 0.04 / 0.09 GiB above `compiled_generation`
at the GSM8K recipe's reset-3 / reset-4 phases. The training step is the peak, so what counts is what generation
leaves allocated while training runs. Here each path (`static_compile_gqa`, what `compiled_generation` runs; and
`rollout_engine`) generates twice at a phase's shape (Qwen2-0.5B architecture, random init, bf16, LoRA as the phase,
the phase's KV cache length, a short cap: what stays allocated does not depend on it), in a fresh process each, with
PyTorch's allocation history on. Reported: memory still allocated after the second generation over what the model
held before (the default stream's cuBLAS workspace already created), the peak during generation, the reserved bytes
of private pools (CUDA graphs), and the largest kept allocations grouped by the code that made them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from _common import device_name, publish, utc_now  # first: the repository on sys.path

import torch  # noqa: E402
from generation import build_model, make_runner  # noqa: E402

# The GSM8K recipe's two largest phases (recipes/prorl_gsm8k_qwen2_0.5b.yaml): rows, KV cache length (prompt budget
# 512 + cap), LoRA rank and targets, temperature, top_p.
PHASES = {
    "reset-3": dict(rows=32, cache_len=512 + 4096, rank=32, targets="q_proj,k_proj", temperature=1.2, top_p=1.0),
    "reset-4": dict(rows=64, cache_len=512 + 6144, rank=64, targets="all-linear", temperature=1.2, top_p=1.0),
}
METHODS = ("static_compile_gqa", "rollout_engine")
CODE_MARKERS = ("prorl_trl/", "transformers/", "peft/", "torch/_inductor/", "torchinductor", "benchmarks/")


def _short(frame: dict) -> str:
    name = frame.get("filename", "?").split("site-packages/")[-1].split("/work/")[-1]
    return f"{name}:{frame.get('line')} {frame.get('name')}"


def origin(frames: list[dict]) -> str:
    """The innermost frame in code we can name (ours, transformers, PEFT, inductor's generated code), and the innermost
    of ours (prorl_trl, benchmarks) that led there; the first frame, or "C++", otherwise."""
    named = [frame for frame in frames if any(marker in frame.get("filename", "") for marker in CODE_MARKERS)]
    if not named:
        return _short(frames[0]) if frames else "(no Python frame: C++)"
    mine = ("prorl_trl/", "benchmarks/")
    ours = next((frame for frame in named if any(m in frame.get("filename", "") for m in mine)), None)
    return _short(named[0]) + ("" if ours is None or ours is named[0] else f" (from {_short(ours)})")


def in_default_pool(segment: dict) -> bool:
    """A segment of `torch.cuda.memory._snapshot()` in the default pool (not a CUDA graph's or the generation arena's
    private pool)."""
    return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)


def kept_allocations(snapshot: dict) -> dict:
    """Active blocks grouped by pool (default / private) and origin; reserved bytes of the private pools (CUDA
    graphs) and of the default pool by stream (the default one, others)."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    reserved: dict[str, int] = defaultdict(int)
    default_stream = torch.cuda.default_stream().cuda_stream if torch.cuda.is_available() else 0
    for segment in snapshot["segments"]:
        pool = "default" if in_default_pool(segment) else "private"
        if pool == "private":
            reserved["private_reserved"] += segment["total_size"]
        elif segment.get("stream", 0) in (0, default_stream):
            reserved["default_stream_reserved"] += segment["total_size"]
        else:
            reserved["other_streams_reserved"] += segment["total_size"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                entry = groups[(pool, origin(block.get("frames", [])))]
                entry[0] += block["size"]
                entry[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        **{key: reserved[key] for key in ("private_reserved", "default_stream_reserved", "other_streams_reserved")},
        "by_origin": [(pool, where, size, count) for (pool, where), (size, count) in ranked],
    }


def measure(method: str, phase: str, smoke: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shape = PHASES[phase]
    model, eos, pad = build_model(smoke, device, torch.bfloat16, shape["rank"], shape["targets"])
    cap = 8 if smoke else 256
    args = argparse.Namespace(
        num_prompts=2, prompt_length=16 if smoke else 512, temperature=shape["temperature"], top_p=shape["top_p"],
        cache_len=None if smoke else shape["cache_len"],
    )  # fmt: skip
    cuda = device.type == "cuda"
    if cuda:
        warm = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        (warm @ warm).sum().item()  # the default stream's cuBLAS workspace exists before we count (training has it)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    run = make_runner(method, model, args, (shape["rows"], cap), eos, pad, device)
    for _ in range(2):
        run()
    row = {"method": method, "phase": phase, "rows": shape["rows"], "cache_len": args.cache_len, "cap": cap}
    if not cuda:
        return row
    torch.cuda.synchronize()
    kept = kept_allocations(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    row.update(
        kept_gib=(torch.cuda.memory_allocated() - before) / 2**30,
        peak_gib=(torch.cuda.max_memory_allocated() - before) / 2**30,
        private_reserved_gib=kept["private_reserved"] / 2**30,
        default_stream_reserved_gib=kept["default_stream_reserved"] / 2**30,
        other_streams_reserved_gib=kept["other_streams_reserved"] / 2**30,
        by_origin=kept["by_origin"][:40],
        device=device_name(),
    )  # fmt: skip
    return row


def render(rows: list[dict]) -> str:
    device = next((r["device"] for r in rows if "device" in r), "CPU")
    lines = [
        f"Device: {device} | {utc_now()} | cap {rows[0]['cap']} tokens, "
        "the phase's KV cache length",
        "",
        "| phase | method | kept after generating (GiB) | peak while generating (GiB) | reserved: default stream "
        "| reserved: other streams | reserved: private pools (CUDA graphs) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['phase']} | {r['method']} | failed: {r['error']} | | | | |")
        elif "kept_gib" in r:
            lines.append(f"| {r['phase']} | {r['method']} | {r['kept_gib']:.3f} | {r['peak_gib']:.3f} | "
                         f"{r['default_stream_reserved_gib']:.3f} | {r['other_streams_reserved_gib']:.3f} | "
                         f"{r['private_reserved_gib']:.3f} |")  # fmt: skip
        else:
            lines.append(f"| {r['phase']} | {r['method']} | (CPU) | | | | |")
    for r in rows:
        if r.get("by_origin"):
            lines += ["", f"Kept allocations, {r['phase']} {r['method']} (largest first, MiB):", ""]
            lines += [f"- {size / 2**20:.1f} MiB in {count} block(s), {pool} pool: `{where}`"
                      for pool, where, size, count in r["by_origin"][:12]]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model: the script runs")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated, from " + ", ".join(PHASES))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "method:phase:json" (a worker process)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.one:
        method, phase, out = args.one.split(":", 2)
        Path(out).write_text(json.dumps(measure(method, phase, args.smoke)))
        return []
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for phase in args.phases.split(","):
            for method in args.methods.split(","):  # a process each: one path's compiled state and pools stay its own
                out = Path(folder) / f"{phase}-{method}.json"
                command = [sys.executable, str(Path(__file__).resolve()), "--one", f"{method}:{phase}:{out}"]
                code = subprocess.run(command + (["--smoke"] if args.smoke else []), check=False).returncode
                rows.append(json.loads(out.read_text()) if code == 0 and out.exists() else
                            {"method": method, "phase": phase, "cap": 0, "error": f"exit code {code}"})  # fmt: skip
    publish(render(rows), json_path=args.json, payload=rows)
    return rows


if __name__ == "__main__":
    main()
