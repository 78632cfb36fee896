"""GPU time of the sampler's kernels: the top-p threshold (`prorl_trl.rollout.top_p_triton`) per vocabulary split
count, block, skip and prefetch setting; then the exponential race after it (`race_triton`) against the same draw
as compiled torch ops.

The decode step's top-p search reads the `(rows, vocab)` float32 probabilities once per pass (8 passes + a finish).
At 32 rows an H100 took ~18 us a pass against ~6.5 us to read 19.4 MB: this sweeps the programs per pass (splits per
row) and the block/warps so the default can be chosen from measurements. Each configuration is captured in a CUDA
graph (as the decode loop runs it) and replayed; the threshold is checked against the default configuration's.

    python benchmarks/top_p_kernel.py                     # one GPU: a markdown table on stdout
    python benchmarks/top_p_kernel.py --rows 64 --vocab 151936
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph_timing import replay_microseconds  # noqa: E402

from prorl_trl.rollout import race_triton, top_p_triton  # noqa: E402
from prorl_trl.rollout.sampler import first_argmax, noise_from_keys, race_tokens, row_keys  # noqa: E402


def probabilities(rows: int, vocab: int, sharpness: float, device: torch.device) -> torch.Tensor:
    """Softmax of Gaussian logits: sharpness 0 is uniform (the search's worst case), larger is more peaked."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator, device=device) * sharpness
    return torch.softmax(logits, dim=-1)


def time_config(probs: torch.Tensor, top_p: torch.Tensor, splits: int, replays: int) -> tuple[float, torch.Tensor]:
    """Microseconds per call (CUDA graph replays) and the thresholds."""
    tau = top_p_triton.launch_top_p_threshold(probs, top_p, splits=splits)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = top_p_triton.launch_top_p_threshold(probs, top_p, splits=splits)
    micros = replay_microseconds(graph, replays)
    assert torch.equal(captured, tau)
    return micros, tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--top-p", type=float, default=0.7)
    parser.add_argument("--splits", default="16,32,64,128")
    parser.add_argument("--blocks", default="256:4,512:4,512:8,1024:8")
    parser.add_argument("--skip-outside", default="on,off",
                        help="top_p_triton.SKIP_OUTSIDE settings to time (blocks outside the bracket skip the sums)")
    parser.add_argument("--prefetch", default="on,off", help="top_p_triton.PREFETCH settings to time")
    parser.add_argument("--sharpness", default="0,0.6,3", help="logit scales: 0 uniform, 0.6 a random Qwen2-0.5B's")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda")
    top_p = torch.tensor([args.top_p], device=device)
    default_block = (top_p_triton.BLOCK, top_p_triton.NUM_WARPS)
    print(f"{torch.cuda.get_device_name()}: {args.rows} x {args.vocab}, top_p {args.top_p}, "
          f"default splits {top_p_triton.splits_for(args.rows, args.vocab)}, block {default_block}")  # fmt: skip
    print("| sharpness | splits | block / warps | skip outside | prefetch | us per call | us per pass | same |")
    print("|---:|---:|---|---|---|---:|---:|---|")
    passes = top_p_triton.passes_needed() + 1
    defaults = (top_p_triton.SKIP_OUTSIDE, top_p_triton.PREFETCH)
    skips = [{"on": True, "off": False}[value.strip()] for value in args.skip_outside.split(",")]
    prefetches = [{"on": True, "off": False}[value.strip()] for value in args.prefetch.split(",")]
    thresholds = {}
    for sharpness in (float(value) for value in args.sharpness.split(",")):
        probs = probabilities(args.rows, args.vocab, sharpness, device)
        top_p_triton.BLOCK, top_p_triton.NUM_WARPS = default_block
        top_p_triton.SKIP_OUTSIDE, top_p_triton.PREFETCH = defaults
        _, reference = time_config(probs, top_p, top_p_triton.splits_for(args.rows, args.vocab), 2)
        thresholds[sharpness] = (probs, reference)
        configs = itertools.product(args.splits.split(","), args.blocks.split(","), skips, prefetches)
        for splits, block, skip, prefetch in configs:
            size, warps = (int(v) for v in block.split(":"))
            top_p_triton.BLOCK, top_p_triton.NUM_WARPS = size, warps
            top_p_triton.SKIP_OUTSIDE, top_p_triton.PREFETCH = skip, prefetch
            micros, tau = time_config(probs, top_p, int(splits), args.replays)
            print(f"| {sharpness} | {splits} | {size} / {warps} | {skip} | {prefetch} | {micros:.1f} | "
                  f"{micros / passes:.1f} | {torch.equal(tau, reference)} |")  # fmt: skip
    top_p_triton.BLOCK, top_p_triton.NUM_WARPS = default_block
    top_p_triton.SKIP_OUTSIDE, top_p_triton.PREFETCH = defaults
    print()
    time_race(thresholds, args.replays, device)


def race_with_torch_ops(probs: torch.Tensor, tau: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race as the compiled step ran it before `race_triton`: masked scores, noise, a chunked argmax."""
    scores = torch.log(probs).masked_fill(probs < tau, -float("inf"))
    return first_argmax(scores - torch.log(-torch.log(noise_from_keys(keys, probs.shape[-1]))))


def time_race(thresholds: dict, replays: int, device: torch.device) -> None:
    """`race_triton`'s kernel (prefetch on/off, its splits' final pick included) against `race_with_torch_ops`
    compiled, CUDA-graph replays, on the probabilities and thresholds of the table above."""
    compiled = torch.compile(race_with_torch_ops, dynamic=False)
    print("| sharpness | race | us per call | same tokens as torch ops |")
    print("|---:|---|---:|---|")
    default = race_triton.PREFETCH
    for sharpness, (probs, tau) in thresholds.items():
        keys = row_keys(torch.tensor([11], device=device), torch.tensor([5], device=device), probs.shape[0])
        expected = compiled(probs, tau, keys)
        for name, run in (("kernel, prefetch", race_tokens), ("kernel, no prefetch", race_tokens),
                          ("compiled torch ops", compiled)):  # fmt: skip
            race_triton.PREFETCH = name != "kernel, no prefetch"
            run(probs, tau, keys)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                tokens = run(probs, tau, keys)
            micros = replay_microseconds(graph, replays)
            print(f"| {sharpness} | {name} | {micros:.1f} | {torch.equal(tokens, expected)} |")
    race_triton.PREFETCH = default


if __name__ == "__main__":
    main()
