"""Sampling throughput of the eval sampler (completions/s) on this machine, for a randomly initialised Qwen2.

`python -m prorl_trl.evaluation.throughput --device cuda --hidden-size 896 --layers 24` (about Qwen2.5-0.5B's
shape) or the CPU defaults (tiny model). Random weights rarely emit EOS, so every completion runs to
`--max-new-tokens`: a worst case for a given length. Prints one table naming the hardware.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from prorl_trl.tiny import build_tiny

from .runner import resolve_device
from .sampling import SamplingSettings, encode_prompt, sample_transformers


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as handle:
            name = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "CPU"
    return f"{name}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--compile", action="store_true", help="static cache + compiled decode (GPU)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = build_tiny(
        seed=0, hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=4096,
    )
    model = model.to(device=device, dtype=dtype).eval()
    prompts = [encode_prompt([{"role": "user", "content": f"Problem {i}: " + "x" * (args.prompt_chars + 7 * i)}], tokenizer)
               for i in range(args.problems)]
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"eval sampler throughput | {hardware(device)} | torch {torch.__version__} | {parameters:.1f}M params {dtype}")
    print(f"{args.problems} problems x n={args.n}, {args.max_new_tokens} new tokens each, compile={args.compile}")
    print("| batch_size | completions | seconds | completions/s | tokens/s |")
    print("|---|---|---|---|---|")
    warm = SamplingSettings(num_samples=1, max_completion_length=4, batch_size=4)
    sample_transformers(model, tokenizer, prompts[:2], warm)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        settings = SamplingSettings(
            num_samples=args.n, max_completion_length=args.max_new_tokens, batch_size=batch_size, compile=args.compile
        )
        if args.compile:  # the first call of a shape compiles; time the second
            sample_transformers(model, tokenizer, prompts, settings)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, stats = sample_transformers(model, tokenizer, prompts, settings)
        seconds = time.perf_counter() - start
        print(f"| {batch_size} | {stats['completions']} | {seconds:.2f} | {stats['completions'] / seconds:.2f} | "
              f"{stats['completion_tokens'] / seconds:.0f} |")


if __name__ == "__main__":
    main()
