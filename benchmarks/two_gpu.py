"""A 2-phase ProRL LoRA run with a hard reset under DDP: replicas identical after every reset, throughput vs 1 process.

    python benchmarks/two_gpu.py              # GPU: 1 process, then `accelerate launch --multi_gpu --num_processes 2`
    python benchmarks/two_gpu.py --smoke      # CPU: tiny model, gloo, torchrun; checks the script runs

The worker (`--worker OUT.json`) trains a Qwen2-0.5B-architecture model (random init, bf16; nothing downloaded) for
two phases: phase 0 with LoRA r=32 on q,k; phase 1 with r=64 on all linear layers (the seed's Reset-4 shape change,
so the reset creates new Parameters, a new optimizer and a new DDP wrapper). At the start of each phase (after the
reset) and at its end, every rank's full parameter vector is gathered and compared bit for bit. Throughput is
completions per second over the steady steps (the first step of each phase is warm-up), with the same per-device
batch in both runs, so 2 processes train twice the completions per step. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import device_name, utc_now  # first: the repository on sys.path


def worker(out_path: str, smoke: bool, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import Qwen2ForCausalLM, TrainerCallback

    from prorl_trl.config import ProRLConfig
    from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer
    from prorl_trl.trainer import ProRLTrainer

    tokenizer = build_tiny_tokenizer()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu" if smoke else f"cuda:{local_rank}")
    if smoke:
        torch.set_num_threads(1)
        model = build_tiny_model(tokenizer, seed=0)
    else:
        from trainer_gpu import qwen2_05b_config

        torch.manual_seed(0)  # same init on every rank (DDP also broadcasts at wrap time)
        with torch.device(device):
            model = Qwen2ForCausalLM(qwen2_05b_config(tokenizer)).to(torch.bfloat16)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id

    def distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def ranks_identical(model) -> dict:
        vector = torch.cat([p.detach().float().flatten() for _, p in sorted(model.named_parameters())])
        if not distributed():
            return {"equal": True, "max_diff": 0.0, "checksum": float(vector.double().sum())}
        gathered = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, vector)
        diff = max(float((gathered[0] - g).abs().max()) for g in gathered)
        return {"equal": all(torch.equal(gathered[0], g) for g in gathered), "max_diff": diff,
                "checksum": float(vector.double().sum())}

    class Probe(TrainerCallback):
        def __init__(self):
            self.trainer, self.records, self.step_times, self._t = None, [], {}, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.records.append(dict(label=f"phase {self.trainer.current_phase.index} start (after reset)",
                                     resets=self.trainer.prorl_resets, **ranks_identical(self.trainer.model)))

        def on_step_begin(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            phase = self.trainer.current_phase.index
            self.step_times.setdefault(phase, []).append(time.perf_counter() - self._t)

        def on_train_end(self, args, state, control, **kwargs):
            self.records.append(dict(label=f"phase {self.trainer.current_phase.index} end",
                                     resets=self.trainer.prorl_resets, **ranks_identical(self.trainer.model)))

    probe = Probe()
    per_device, group = (2, 2) if smoke else (8, 8)
    args = ProRLConfig(
        output_dir=tempfile.mkdtemp(prefix="two_gpu_"),
        per_device_train_batch_size=per_device,
        num_generations=group,
        max_completion_length=6 if smoke else 128,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=not smoke,
        use_cpu=smoke,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        save_merged_on_reset=False,
        phases=[
            {"name": "initial", "max_steps": steps},
            {"name": "reset-1", "max_steps": steps, "lora_r": 64 if not smoke else 8, "lora_alpha": 128 if not smoke else 16,
             "lora_target_modules": "all-linear"},
        ],
    )
    trainer = ProRLTrainer(
        model=model,
        reward_funcs=lambda completion_ids, **kw: [(sum(ids) % 13) / 13 for ids in completion_ids],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(512)]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4 if smoke else 32, lora_alpha=8 if smoke else 64, target_modules=["q_proj", "k_proj"],
                               task_type="CAUSAL_LM"),
        callbacks=[probe],
    )
    probe.trainer = trainer
    trainer.train()
    world = dist.get_world_size() if distributed() else 1
    steady = [t for times in probe.step_times.values() for t in times[1:]] or [t for ts in probe.step_times.values() for t in ts]
    completions_per_step = per_device * world * args.gradient_accumulation_steps
    result = {
        "world_size": world,
        "records": probe.records,
        "resets": trainer.prorl_resets,
        "final_rank": trainer.model.peft_config["default"].r,
        "median_step_s": statistics.median(steady),
        "completions_per_step": completions_per_step,
        "completions_per_s": completions_per_step / statistics.median(steady),
        "device": device_name(device),
    }
    if not distributed() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))


def launch(processes: int, smoke: bool, steps: int, out: Path) -> dict:
    script = str(Path(__file__).resolve())
    tail = [script, "--worker", str(out), "--steps", str(steps)] + (["--smoke"] if smoke else [])
    if processes == 1:
        command = [sys.executable] + tail
    elif smoke:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)] + tail
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--mixed_precision", "bf16"] + tail
    print("$", " ".join(command), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if processes == 1 and not smoke:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # one GPU, no DataParallel
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def table(one: dict, two: dict) -> str:
    lines = [
        f"Device: {two['device']} x {two['world_size']} vs x 1 | {utc_now()}",
        "",
        "| processes | resets | final LoRA r | ranks identical after each reset and phase end | max |Δ| across ranks | "
        "median step (s) | completions/step | completions/s | x 1 process |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for result in (one, two):
        identical = all(r["equal"] for r in result["records"])
        max_diff = max(r["max_diff"] for r in result["records"])
        lines.append(
            f"| {result['world_size']} | {result['resets']} | {result['final_rank']} | "
            f"{'yes' if identical else 'NO'} ({len(result['records'])} checks) | {max_diff:.1e} | "
            f"{result['median_step_s']:.2f} | {result['completions_per_step']} | {result['completions_per_s']:.1f} | "
            f"{result['completions_per_s'] / one['completions_per_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo: checks the script runs.")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per phase (default 4; smoke 2).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="Also write the table (and raw JSON) here.")
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.smoke else 4)
    if args.worker:
        worker(args.worker, args.smoke, steps)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        one = launch(1, args.smoke, steps, Path(tmp) / "one.json")
        two = launch(2, args.smoke, steps, Path(tmp) / "two.json")
    text = table(one, two)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n\nRaw:\n\n```json\n" + json.dumps({"one": one, "two": two}, indent=1) + "\n```\n")
    identical = all(r["equal"] for result in (one, two) for r in result["records"])
    return 0 if identical and two["resets"] >= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
