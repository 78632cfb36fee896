"""ProRLTrainer overhead, hard-reset time and memory stability on one GPU; prints one markdown table.

    python benchmarks/trainer_gpu.py            # GPU: Qwen2-0.5B architecture (random init, bf16), LoRA r=64 all-linear
    python benchmarks/trainer_gpu.py --smoke    # CPU, tiny model, < 60 s: checks the script runs

Measured in one process:
(a) step time of `ProRLTrainer` (one phase, no reset) vs `GRPOTrainer` with identical settings and identical model
    init, run in interleaved rounds (order alternating per round; round 0 is warm-up), median per optimizer step
    (step start to next step start: generation, loss, optimizer, callbacks and logging).
    Target: ratio <= 1.02.
(b) `hard_reset()` wall time inside training (`HardResetCallback(every_steps=1)`: merge r=64 LoRA into all linear
    layers, fresh adapter, optimizer state cleared, new LR schedule), bracketed by `torch.cuda.synchronize()`, merged
    save off. Target: <= 1 s. The merged save (`save_merged_on_reset`) is timed separately (disk-bound).
(c) GPU memory allocated / reserved right after reset 1 and after reset 10 of the same run. Target: within 1%.
The model is built from a hand-written `Qwen2Config` with Qwen2-0.5B's sizes (nothing is downloaded); prompts use the
tiny byte-level tokenizer, so prompt ids stay < 265 (ids the tokenizer does not know are dropped when decoding).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import device_name, fmt, publish, synchronize, versions  # first: the repository on sys.path

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from prorl_trl.trainer.callbacks import HardResetCallback  # noqa: E402
from prorl_trl.config import ProRLConfig  # noqa: E402
from prorl_trl.reset import save_merged_model  # noqa: E402
from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402


def qwen2_05b_config(tokenizer) -> Qwen2Config:
    """Qwen2-0.5B's architecture (from benchmarks/generation.py, so both benchmarks time the same model) with the tiny
    tokenizer's special-token ids."""
    spec = importlib.util.spec_from_file_location("generation_benchmark", Path(__file__).with_name("generation.py"))
    generation_benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generation_benchmark)
    config = generation_benchmark.qwen2_05b_config()
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    return config


def build_model(smoke: bool, tokenizer, device: torch.device):
    if smoke:
        return build_tiny_model(tokenizer, seed=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_05b_config(tokenizer)).to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def token_hash_reward(completion_ids, **kwargs):
    """Cheap, deterministic, varies within groups (so the loss has a gradient)."""
    return [(sum(ids) % 13) / 13 for ids in completion_ids]


def memory_mib(device: torch.device) -> tuple[float, float | None]:
    """(allocated, reserved) in MiB on CUDA; (process RSS, None) on CPU."""
    gc.collect()
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.memory_reserved(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20, None


class StepTimer(TrainerCallback):
    """Time from one step's start to the next (the last step ends at `on_train_end`), so the step's logging, which
    `ProRLTrainer.log` extends, is included."""

    def __init__(self, device):
        self.device, self.times, self._marks = device, [], []

    def _mark(self):
        synchronize(self.device)
        self._marks.append(time.perf_counter())

    def on_train_begin(self, args, state, control, **kwargs):
        self._marks = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._mark()

    def on_train_end(self, args, state, control, **kwargs):
        self._mark()
        self.times.extend(later - earlier for earlier, later in zip(self._marks, self._marks[1:]))


class ResetProbe(TrainerCallback):
    """Two instances bracket `HardResetCallback` in the callback list: reset wall time and memory after each reset."""

    def __init__(self, device, shared: dict, is_start: bool):
        self.device, self.shared, self.is_start = device, shared, is_start

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        trainer = self.shared["trainer"]
        if self.is_start:
            self.shared["t0"], self.shared["resets_before"] = time.perf_counter(), trainer.prorl_resets
        elif trainer.prorl_resets > self.shared["resets_before"]:
            self.shared["reset_times"].append(time.perf_counter() - self.shared["t0"])
            self.shared["memory"][trainer.prorl_resets] = memory_mib(self.device)


def common_args(smoke: bool, output_dir: str, max_steps: int) -> dict:
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=4 if smoke else 8,
        num_generations=4 if smoke else 8,
        max_completion_length=8 if smoke else 128,
        max_steps=max_steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=not smoke,
        use_cpu=smoke,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )


def lora_config(smoke: bool) -> LoraConfig:
    rank = 8 if smoke else 64
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(cls, smoke, tokenizer, dataset, device, output_dir, max_steps, callbacks, **extra):
    config_cls = ProRLConfig if cls is ProRLTrainer else GRPOConfig
    args = config_cls(**common_args(smoke, output_dir, max_steps), **extra)
    return cls(
        model=build_model(smoke, tokenizer, device),
        reward_funcs=token_hash_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(smoke),
        callbacks=callbacks,
    )


def measure_step_times(smoke, tokenizer, dataset, device, workdir, rounds, steps) -> dict[str, list[float]]:
    """(a): interleaved rounds of `steps` optimizer steps per trainer; round 0 is warm-up and dropped."""
    timers = {"GRPOTrainer": StepTimer(device), "ProRLTrainer": StepTimer(device)}
    trainers = {
        "GRPOTrainer": make_trainer(GRPOTrainer, smoke, tokenizer, dataset, device, f"{workdir}/grpo", steps, [timers["GRPOTrainer"]]),
        "ProRLTrainer": make_trainer(
            ProRLTrainer, smoke, tokenizer, dataset, device, f"{workdir}/prorl", steps, [timers["ProRLTrainer"]],
            hard_reset_between_phases=False, save_merged_on_reset=False,
        ),
    }  # fmt: skip
    measured: dict[str, list[float]] = {name: [] for name in trainers}
    for round_index in range(rounds):
        order = list(trainers) if round_index % 2 == 0 else list(reversed(trainers))
        for name in order:
            trainer = trainers[name]
            trainer.optimizer, trainer.lr_scheduler = None, None  # same fresh start for both every round
            timers[name].times.clear()
            trainer.train()
            if round_index > 0:
                measured[name].extend(timers[name].times)
    del trainers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def measure_resets(smoke, tokenizer, dataset, device, workdir, resets) -> dict:
    """(b) and (c): one ProRL run of `resets + 1` steps with a hard reset after each step but the last."""
    shared: dict = {"reset_times": [], "memory": {}}
    callbacks = [ResetProbe(device, shared, True), HardResetCallback(every_steps=1), ResetProbe(device, shared, False)]
    trainer = make_trainer(
        ProRLTrainer, smoke, tokenizer, dataset, device, f"{workdir}/resets", resets + 1, callbacks,
        save_merged_on_reset=False,
    )  # fmt: skip
    shared["trainer"] = trainer
    trainer.train()
    synchronize(device)
    start = time.perf_counter()
    save_merged_model(trainer.model, tokenizer, Path(workdir) / "merged")
    synchronize(device)
    shared["save_time"] = time.perf_counter() - start
    return shared


def table(device: str, settings: str, steps: dict, resets: dict, num_resets: int) -> str:
    grpo, prorl = statistics.median(steps["GRPOTrainer"]), statistics.median(steps["ProRLTrainer"])
    ratio = prorl / grpo
    reset_median, reset_max = statistics.median(resets["reset_times"]), max(resets["reset_times"])
    (alloc_1, reserved_1), (alloc_n, reserved_n) = resets["memory"][1], resets["memory"][num_resets]

    def drift(first, last):
        return None if first is None else 100 * (last - first) / first

    alloc_drift, reserved_drift = drift(alloc_1, alloc_n), drift(reserved_1, reserved_n)
    memory_unit = "GPU MiB" if reserved_1 is not None else "CPU RSS MiB"
    ok = {True: "yes", False: "**no**", None: "n/a"}
    rows = [
        (f"step time, median of {len(steps['GRPOTrainer'])} steps (s)", fmt(grpo, '.3f', 'n/a'), fmt(prorl, '.3f', 'n/a'), f"ratio {ratio:.3f}", "<= 1.02", ok[ratio <= 1.02]),
        (f"hard_reset() in training, median / max of {len(resets['reset_times'])} (s)", "", f"{fmt(reset_median, '.3f', 'n/a')} / {fmt(reset_max, '.3f', 'n/a')}", "", "<= 1 s", ok[reset_max <= 1.0]),
        ("merged save of the full model (s, disk-bound, informational)", "", fmt(resets["save_time"], '.2f', 'n/a'), "", "", ""),
        (f"memory allocated after reset 1 / {num_resets} ({memory_unit})", "", f"{fmt(alloc_1, '.1f', 'n/a')} / {fmt(alloc_n, '.1f', 'n/a')}", f"{fmt(alloc_drift, '.2f', 'n/a')} %", "within 1 %", ok[abs(alloc_drift) <= 1.0]),
        (f"memory reserved after reset 1 / {num_resets} (GPU MiB)", "", f"{fmt(reserved_1, '.1f', 'n/a')} / {fmt(reserved_n, '.1f', 'n/a')}", f"{fmt(reserved_drift, '.2f', 'n/a')} %", "within 1 %", ok[None if reserved_drift is None else abs(reserved_drift) <= 1.0]),
    ]  # fmt: skip
    lines = [
        f"| ProRLTrainer on {device} ({settings}) | GRPOTrainer | ProRLTrainer | result | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU + tiny model, a few steps: checks the script runs.")
    parser.add_argument("--rounds", type=int, default=None, help="Interleaved rounds for (a), round 0 is warm-up.")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per trainer per round for (a).")
    parser.add_argument("--resets", type=int, default=None, help="Hard resets in the (b)/(c) run (>= 2; default 10).")
    parser.add_argument("--out", type=Path, default=None, help="Also write the table to this file.")
    args = parser.parse_args(argv)
    args.resets = args.resets or (3 if args.smoke else 10)
    if args.resets < 2:
        parser.error("--resets must be >= 2 (memory after reset 1 is compared with the last).")
    rounds = args.rounds or (2 if args.smoke else 4)
    steps = args.steps or (2 if args.smoke else 5)
    if rounds < 2:
        parser.error("--rounds must be >= 2 (round 0 is warm-up).")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke for the CPU check.")

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)) if args.smoke else torch.get_num_threads())
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    tokenizer = build_tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Problem {i}: compute {i} + {3 * i + 1}." for i in range(256)]})
    run = common_args(args.smoke, "", 0)
    model_name = "tiny Qwen2 (fp32)" if args.smoke else "Qwen2-0.5B architecture, random init, bf16"
    settings = (
        f"{model_name}, LoRA r={lora_config(args.smoke).r} all-linear, batch {run['per_device_train_batch_size']} x "
        f"G={run['num_generations']}, {run['max_completion_length']} new tokens, {versions('torch')}"
    )
    with tempfile.TemporaryDirectory(prefix="prorl-bench-") as workdir:
        step_times = measure_step_times(args.smoke, tokenizer, dataset, device, workdir, rounds, steps)
        resets = measure_resets(args.smoke, tokenizer, dataset, device, workdir, args.resets)
    result = table(device_name(device, cpu="CPU (smoke)"), settings, step_times, resets, args.resets)
    publish(result, args.out)
    return result


if __name__ == "__main__":
    main()
