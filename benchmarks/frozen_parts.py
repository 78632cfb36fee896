"""What frozen LoRA parts cost a training forward + backward, one part per reset or joined into one
(`consolidate_frozen_parts`), against the same adapter with no reset.

    python benchmarks/frozen_parts.py                       # GPU when there is one, else CPU; prorl_study model
    python benchmarks/frozen_parts.py --smoke               # tiny model, a few repeats (tests/test_benchmark_*)

The model is issue 29's study model (`learning.GPU_MODEL`: 19.2M parameters, Qwen2 shape, bf16 on GPU, float32 on
CPU) with LoRA r8 on all 7 projections, as `benchmarks/prolonged.py` runs it; one micro-batch of `--batch`
sequences of `--length` tokens. For k resets, k deltas are frozen (random B, a fresh adapter after each), one part
each or joined, and the median time of `--repeat` forward + backward passes is reported: the part of a training step
the parts add to (the rollout engine's decode adds its own, not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import device_name, publish, utc_now, versions  # first: the repository on sys.path

import learning  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--resets", default="0,1,2,3,4", help="comma separated numbers of resets")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.length, args.repeat, args.resets = 2, 8, 2, "0,2"
    return args


def build(args, resets: int, joined: bool):
    import torch
    from peft import LoraConfig, get_peft_model

    from prorl_trl.reset import freeze_lora_delta, reinit_adapter
    from prorl_trl.tiny import build_tiny

    cuda = torch.cuda.is_available() and not args.smoke
    shape = learning.SMOKE_MODEL if args.smoke else learning.GPU_MODEL
    model = build_tiny(seed=0, **shape)[0].to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))
    with torch.no_grad():
        for reset in range(resets):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-3)
            freeze_lora_delta(model, consolidate=joined)
            reinit_adapter(model, seed=reset)
    return model.train()


def time_step(model, args) -> float:
    """Median seconds of one forward + backward of the micro-batch."""
    import torch

    device = next(model.parameters()).device
    ids = torch.randint(3, 200, (args.batch, args.length), device=device)
    times = []
    for _ in range(args.repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids).logits.float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> list[dict]:
    from prorl_trl.reset import frozen_layers

    args = parse_args(argv)
    device = "CPU" if args.smoke else device_name()
    rows = []
    for resets in [int(r) for r in args.resets.split(",")]:
        row = {"resets": resets}
        for joined in (False, True):
            model = build(args, resets, joined)
            parts = max((len(f.scalings) for _, _, f in frozen_layers(model)), default=0)
            row["joined" if joined else "separate"] = time_step(model, args)
            row["parts_joined" if joined else "parts_separate"] = parts
        rows.append(row)
    base = rows[0]["separate"] if rows and rows[0]["resets"] == 0 else None
    title = (
        f"Frozen parts: forward + backward of {args.batch} x {args.length} tokens, LoRA r{args.rank} on 7 projections "
        f"({device}, {versions('torch')}, {utc_now()}; median of {args.repeat})"
    )
    header = "| resets | one part per reset: parts, ms | joined: parts, ms | joined / separate |"
    lines = [
        title,
        "",
        header + (" separate / no reset |" if base else ""),
        "| --- | --- | --- | --- |" + (" --- |" if base else ""),
    ]
    for row in rows:
        ratio = row["joined"] / row["separate"]
        extra = f" {row['separate'] / base:.2f} |" if base else ""
        lines.append(f"| {row['resets']} | {row['parts_separate']}, {1e3 * row['separate']:.1f} | "
                     f"{row['parts_joined']}, {1e3 * row['joined']:.1f} | {ratio:.2f} |{extra}")  # fmt: skip
    publish("\n".join(lines), args.out)
    return rows


if __name__ == "__main__":
    main()
