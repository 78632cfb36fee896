"""Gate/up's LoRA A products at the reset-4 shape: `lora_a_product`'s kernel against inductor's reduction, and the
kernel's tiles, microseconds a layer.

Why: before the kernel, inductor fused the residual add, the post-attention norm and gate/up's A products into one
reduction that took 7.5 us a layer on an H200 (2026-11-30); the kernel leaves the add and the norm to inductor's own
kernel and multiplies the normed rows by the A weights' folded bf16 high and low rows. This times, over 24 layers with
their own weights in one CUDA graph:
- `inductor: add + norm + A products`: the engine's former form, one compiled function over the float32 A weights;
- `inductor: add + norm alone`;
- `inductor: add + norm, then the kernel`: the engine's form now, for each tile setting (rows, ranks and input
  features a program, warps), and the kernel alone;
and checks every method's products against float64 products of its own normed rows (relative error under 1e-4).

    python benchmarks/lora_a_tiles.py --rows 64 --out a.md    # CUDA
    python benchmarks/lora_a_tiles.py --smoke                 # CPU: the settings grid and the table, no kernel
"""

from __future__ import annotations

import argparse

from _common import device_name, error_line, int_grid, int_list, publish, replay_microseconds, utc_now  # first

import torch  # noqa: E402

from prorl_trl.rollout.decode_attention import triton_available  # noqa: E402

HIDDEN, RANK, LAYERS, EPS = 896, 64, 24, 1e-6  # Qwen2-0.5B's hidden size, the recipe's reset-4 rank, its layers
TIMING = {"launches": 1, "samples": 10, "warm_replay": True}


def settings_grid(blocks_m: str, blocks_r: str, blocks_k: str, warps: str) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, warps) combinations of the comma-separated values."""
    return int_grid(blocks_m, blocks_r, blocks_k, warps)


def add_and_norm(hidden: torch.Tensor, attended: torch.Tensor, weight: torch.Tensor):
    """The decoder layer's residual add and Qwen2's RMSNorm: `(new residual, normed)` in bf16."""
    hidden = hidden + attended
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    return hidden, weight * (hidden.float() * torch.rsqrt(variance + EPS)).to(hidden.dtype)


def fused_reference(hidden, attended, weight, downs):
    """The engine's former form: the add, the norm and the A products' reduction over the float32 A weights."""
    hidden, normed = add_and_norm(hidden, attended, weight)
    down = torch.cat(downs)
    return normed, (normed.float()[:, None, :] * down).sum(-1)


def run(rows: int, settings: list[tuple[int, int, int, int]], device) -> list[dict]:
    """Each method's microseconds a layer and whether its products match float64 ones."""
    from prorl_trl.rollout import lora_a_product
    from prorl_trl.rollout.lora_a_product_triton import launch_a_product

    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device=device, generator=generator) * scale).to(dtype)

    layers = []
    for _ in range(LAYERS):
        downs = [randn(RANK, HIDDEN, scale=0.03) for _ in range(2)]
        high = torch.cat(downs).to(torch.bfloat16)
        layers.append(dict(hidden=randn(rows, HIDDEN, dtype=torch.bfloat16),
                           attended=randn(rows, HIDDEN, dtype=torch.bfloat16),
                           weight=randn(HIDDEN, scale=0.1, dtype=torch.bfloat16) + 1, downs=downs,
                           a_rows=torch.cat([high, (torch.cat(downs) - high.float()).to(torch.bfloat16)])))
    compiled_fused = torch.compile(fused_reference, dynamic=False)
    compiled_norm = torch.compile(add_and_norm, dynamic=False)

    def matches(outputs) -> bool:
        for (normed, got), layer in zip(outputs, layers):
            exact = normed.double() @ torch.cat(layer["downs"]).double().T
            if ((got.double() - exact).norm() / exact.norm()).item() > 1e-4:
                return False
        return True

    def fused():
        return [compiled_fused(l["hidden"], l["attended"], l["weight"], l["downs"]) for l in layers]

    results = [{"rows": rows, "method": "inductor: add + norm + A products", "us": replay_microseconds(fused, **TIMING),
                "matches": matches(fused())}]  # fmt: skip
    print(results[-1], flush=True)
    norm_only = lambda: [compiled_norm(l["hidden"], l["attended"], l["weight"])[1] for l in layers]  # noqa: E731
    results.append({"rows": rows, "method": "inductor: add + norm alone",
                    "us": replay_microseconds(norm_only, **TIMING)})  # fmt: skip
    print(results[-1], flush=True)
    engine = (lora_a_product.BLOCK_M, lora_a_product.BLOCK_R, lora_a_product.BLOCK_K, lora_a_product.NUM_WARPS)
    normed = norm_only()
    for setting in [engine] + [s for s in settings if s != engine]:
        block_m, block_r, block_k, warps = setting
        row = {"rows": rows, "method": "inductor: add + norm, then the kernel", "setting": setting}

        def with_kernel():
            outputs = []
            for layer in layers:
                normed_here = compiled_norm(layer["hidden"], layer["attended"], layer["weight"])[1]
                outputs.append((normed_here, launch_a_product(normed_here, layer["a_rows"], 2 * RANK, block_m, block_r,
                                                              block_k, warps)))  # fmt: skip
            return outputs

        try:
            row["us"] = replay_microseconds(with_kernel, **TIMING)
            row["kernel alone us"] = replay_microseconds(
                lambda: [launch_a_product(n, l["a_rows"], 2 * RANK, block_m, block_r, block_k, warps)
                         for n, l in zip(normed, layers)], **TIMING)  # fmt: skip
            row["matches"] = matches(with_kernel())
        except Exception as error:  # one failing setting must not hide the others' numbers
            row["error"] = error_line(error)
        results.append(row)
        print(row, flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64", help="rows (sequences), comma separated")
    parser.add_argument("--blocks-m", default="16,32")
    parser.add_argument("--blocks-r", default="16,32")
    parser.add_argument("--blocks-k", default="64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--smoke", action="store_true", help="CPU: the grid and the table only (no Triton kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    settings = settings_grid(args.blocks_m, args.blocks_r, args.blocks_k, args.warps)
    results = []
    if device.type == "cuda" and triton_available():
        for rows in int_list(args.rows):
            results += run(rows, settings, device)
    lines = [
        f"Device: {device_name(device)} | {utc_now()} | torch {torch.__version__} | {LAYERS} layers of hidden size "
        f"{HIDDEN}, gate and up r{RANK} adapters (float32 A weights; the kernel: their bf16 high and low rows), bf16 "
        "inputs | microseconds a layer, CUDA-graph replays of all layers; per row count the first kernel line is the "
        "engine's setting",
        "",
        "| rows | method | BLOCK_M, BLOCK_R, BLOCK_K, warps | us a layer | kernel alone (us) | matches |",
        "|---:|---|---|---:|---:|---|",
    ]
    for row in results:
        setting = ", ".join(str(v) for v in row["setting"]) if "setting" in row else ""
        head = f"| {row['rows']} | {row['method']} | {setting} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error']} | | |")
            continue
        alone = f"{row['kernel alone us'] / LAYERS:.2f}" if "kernel alone us" in row else ""
        lines.append(f"{head} {row['us'] / LAYERS:.2f} | {alone} | {row.get('matches', '')} |")
    if not results:
        lines.append(f"(no CUDA with Triton here: {len(settings)} settings not run)")
    publish("\n".join(lines) + "\n", args.out)
    return results


if __name__ == "__main__":
    main()
