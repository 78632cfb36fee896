"""Tile settings of `fused_mlp`'s kernel (the gated MLP's first half where gate/up carry LoRA adapters), timed alone.

At the seed's reset-4 shape (64 rows, LoRA r64 on every linear layer, Qwen2-0.5B: 896 -> 2 x 4,864) the kernel took
756 us of a 2.70 ms decode step on an H200 (31.5 us a layer, 0.55 TB/s of its 17.4 MB of weights; the profile of
2026-11-29, benchmarks/results/rollout_engine.md). Its tiles (BLOCK_N 32: 152 programs, one K loop each) date from
commit 1c1b24d. This times every setting of a grid on one layer's shapes in CUDA-graph replays, checks each against
`gated_activation_reference`, and prints one table per row count, fastest first.

    python benchmarks/fused_mlp_tiles.py                     # CUDA: the grid, rows 16, 64, 100
    python benchmarks/fused_mlp_tiles.py --rows 64 --block-n 16,32 --block-k 128 --warps 4 --stages 3
    python benchmarks/fused_mlp_tiles.py --smoke             # CPU: torch ops on a small layer (checks the script)
"""

from __future__ import annotations

import argparse
import itertools

from _common import device_name, publish, replay_microseconds, utc_now  # first: the repository on sys.path

import torch  # noqa: E402

from prorl_trl.rollout.fused_mlp import LoraDelta, gated_activation_reference, power_of_two, tile_layout  # noqa: E402

HIDDEN, INTERMEDIATE = 896, 4864  # Qwen2-0.5B
SMOKE_HIDDEN, SMOKE_INTERMEDIATE = 64, 96


def layer_inputs(rows: int, rank: int, device: torch.device, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE):
    """bf16 input and fused gate/up weight, float32 LoRA deltas on both (as PEFT's adapters on the recipe's model)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, hidden, generator=generator).to(device, torch.bfloat16)
    weight = (torch.randn(2 * intermediate, hidden, generator=generator) / hidden**0.5).to(device, torch.bfloat16)
    if rank == 0:
        return x, weight, [None, None]
    deltas = [
        LoraDelta(torch.randn(rows, rank, generator=generator).to(device) * 0.1,
                  (torch.randn(intermediate, rank, generator=generator) * 0.01).to(device), 2.0)
        for _ in range(2)
    ]  # fmt: skip
    return x, weight, deltas


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,16,100", help="row counts (decode batch sizes), comma separated")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank on gate and up (0: no adapters)")
    parser.add_argument("--block-n", default="16,32,64", help="gate (and up) columns a program")
    parser.add_argument("--block-k", default="64,128,256", help="input width a K-loop iteration")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--lora-precision", default="bf16x3,tf32x3,ieee",
                        help="the LoRA deltas' products (fused_mlp.LORA_PRECISIONS; bf16x3 the default)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", default=None, help="write the tables here (markdown)")
    parser.add_argument("--smoke", action="store_true", help="CPU: torch ops on a small layer, one setting")
    args = parser.parse_args(argv)
    hidden, intermediate = HIDDEN, INTERMEDIATE
    if args.smoke:
        hidden, intermediate = SMOKE_HIDDEN, SMOKE_INTERMEDIATE
        args.rows, args.rank, args.block_n, args.block_k, args.warps, args.stages = "4", 8, "32", "128", "4", "3"
        args.lora_precision, args.replays = "bf16x3", 2
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    precisions = args.lora_precision.split(",")
    grid = list(itertools.product(ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages),
                                  precisions))  # fmt: skip
    lines = [f"{device_name(device)}, torch {torch.__version__}, {utc_now()}: `fused_mlp` kernel, one layer "
             f"({hidden} -> 2 x {intermediate}, LoRA r{args.rank} on gate and up), "
             + ("torch ops (smoke)" if args.smoke else "CUDA-graph replays")]  # fmt: skip
    results = []
    for rows in ints(args.rows):
        x, weight, (gate, up) = layer_inputs(rows, args.rank, device, hidden, intermediate)
        reference = gated_activation_reference(x.float(), weight.float(), gate, up)
        same_function = gated_activation_reference(x, weight, gate, up)  # torch ops: bf16 GEMM, float32 LoRA products
        default = tile_layout(rows, intermediate)
        block_m = power_of_two(rows, 16, 64)
        table = []
        for block_n, block_k, warps, stages, precision in grid:
            def launch(block_n=block_n, block_k=block_k, warps=warps, stages=stages, precision=precision):
                if args.smoke:  # no Triton on a CPU torch: the function the kernel computes
                    return gated_activation_reference(x, weight, gate, up)
                from prorl_trl.rollout.fused_mlp_triton import launch_gated_activation

                return launch_gated_activation(x, weight, gate, up, (block_m, block_n), block_k, warps, stages,
                                               lora_precision=precision)  # fmt: skip

            try:
                output = launch()
                micros = replay_microseconds(launch, args.replays)
            except Exception as error:  # noqa: BLE001 - a setting the compiler or the GPU refuses (shared memory)
                table.append({"rows": rows, "setting": (block_n, block_k, warps, stages, precision),
                              "error": str(error)[:80]})  # fmt: skip
                continue
            error = float((output.float() - reference).norm() / reference.norm())
            differing = float((output != same_function).float().mean())
            tiles = (block_m, block_n) == default and (block_k, warps, stages) == (128, 4, 3)
            table.append({"rows": rows, "setting": (block_n, block_k, warps, stages, precision), "us": micros,
                          "error": error, "differing": differing, "default": tiles})  # fmt: skip
        table.sort(key=lambda r: r.get("us", float("inf")))
        results += table
        lines += ["", f"**{rows} rows** (BLOCK_M {block_m})", "",
                  "| BLOCK_N:BLOCK_K:warps:stages:LoRA products | us | error vs float32 | outputs != torch ops "
                  "| |", "|---|---:|---:|---:|---|"]  # fmt: skip
        for row in table:
            setting = ":".join(str(v) for v in row["setting"])
            if "error" in row and "us" not in row:
                lines.append(f"| {setting} | - | {row['error']} | | |")
                continue
            mark = "the tiles of commit 1c1b24d" if row["default"] else ""
            lines.append(f"| {setting} | {row['us']:.1f} | {row['error']:.1e} | {row['differing']:.2%} | {mark} |")
    publish("\n".join(lines), args.out)
    return results


if __name__ == "__main__":
    main()
