"""What a small LoRA product's operand precision costs in a Triton kernel: float32 operands as three TF32 products,
one TF32 product or IEEE float32, against bf16 operands (one product, or the high and low bf16 rows of a float32
weight: two products), microseconds a layer.

Why: `lora_a_product`'s first form multiplied 16-bit rows by float32 A weights as three TF32 products and lost its
A/B (2026-11-30, benchmarks/results/rollout_engine.md, section from 06:58 UTC). This times the product alone, `x (rows,
features) bf16 @ A.T (ranks, features)` into float32, the shape of gate/up's A products at the GSM8K recipe's
reset-4 (64 rows, 2 x r64, 896 features), 24 layers with their own weights in one CUDA graph, over tiles (rows, ranks
and features a program, warps, pipeline stages) and over splits of the features across programs (partial sums only,
no merge: what a split could save at most). Each row gives the relative error against float64 products of the same
float32 weights. The engine's choices it informed: `lora_a_product` over bf16 high/low rows, and
`fused_mlp.LORA_PRECISION` "bf16x3" for the B products.

    python benchmarks/small_product_precision.py --out p.md     # CUDA
    python benchmarks/small_product_precision.py --smoke        # CPU: the settings and the table, no kernel
"""

from __future__ import annotations

import argparse
import itertools

from _common import device_name, error_line, publish, replay_microseconds, utc_now  # first: the repository on path

import torch  # noqa: E402

ROWS, FEATURES, RANKS, LAYERS = 64, 896, 128, 24  # the reset-4 gate/up A products: 64 rows, 2 x r64, hidden 896
TIMING = {"launches": 1, "samples": 10, "warm_replay": True}
# mode -> (operands, products): the float32 weights' modes run `tl.dot` at that input precision
MODES = {
    "tf32x3": "float32 A, three TF32 products",
    "tf32": "float32 A, one TF32 product",
    "ieee": "float32 A, IEEE float32",
    "bf16": "A rounded to bf16, one bf16 product",
    "bf16 high/low": "A as bf16 high and low rows, two bf16 products",
}
# (BLOCK_M, BLOCK_R, BLOCK_K, warps, stages, feature splits)
SETTINGS = [(16, 16, 128, 4, 3, 1), (16, 32, 128, 4, 3, 1), (16, 16, 128, 4, 1, 1), (16, 16, 64, 4, 3, 7),
            (16, 16, 128, 4, 3, 7), (16, 32, 128, 4, 3, 7), (64, 16, 128, 4, 3, 7), (16, 16, 128, 2, 1, 7)]  # fmt: skip


def settings_for(features: int) -> list[tuple[int, int, int, int, int, int]]:
    """`SETTINGS` whose feature splits divide `features` into whole `BLOCK_K` steps."""
    return [s for s in SETTINGS if features % s[5] == 0 and (features // s[5]) % s[2] == 0]


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton: --smoke renders the table only
    triton = None

if triton is not None:

    @triton.jit
    def _product(X, A, High, Low, Out, M, K: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
        """`x @ A.T` partial sums of one feature split per program (`MODES`' operands and products)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        split = tl.program_id(2)
        share = K // SPLITS
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for first in range(split * share, split * share + share, BLOCK_K):
            features = first + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * K + features[None, :], mask=(rows < M)[:, None], other=0.0)
            at = ranks[:, None] * K + features[None, :]
            if MODE == "bf16":
                acc += tl.dot(x, tl.trans(tl.load(High + at)))
            elif MODE == "bf16 high/low":
                acc += tl.dot(x, tl.trans(tl.load(High + at)))
                acc += tl.dot(x, tl.trans(tl.load(Low + at)))
            else:
                acc += tl.dot(x.to(tl.float32), tl.trans(tl.load(A + at)), input_precision=MODE)
        tl.store(Out + split * M * R + rows[:, None] * R + ranks[None, :], acc, mask=(rows < M)[:, None])


def run(device) -> list[dict]:
    """Each (mode, setting): microseconds a layer and the relative error of its products."""
    generator = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(ROWS, FEATURES, device=device, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    weights = [torch.randn(RANKS, FEATURES, device=device, generator=generator) * 0.03 for _ in range(LAYERS)]
    highs = [w.to(torch.bfloat16) for w in weights]
    lows = [(w - h.float()).to(torch.bfloat16) for w, h in zip(weights, highs)]
    exact = xs[0].double() @ weights[0].double().T
    results = []
    for mode, setting in itertools.product(MODES, settings_for(FEATURES)):
        block_m, block_r, block_k, warps, stages, splits = setting
        outs = [torch.empty(splits, ROWS, RANKS, device=device) for _ in range(LAYERS)]
        grid = (triton.cdiv(ROWS, block_m), RANKS // block_r, splits)

        def launch():
            for layer in range(LAYERS):
                _product[grid](xs[layer], weights[layer], highs[layer], lows[layer], outs[layer], ROWS, K=FEATURES,
                              R=RANKS, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, MODE=mode, SPLITS=splits,
                              num_warps=warps, num_stages=stages)  # fmt: skip

        row = {"mode": mode, "setting": setting, "programs": grid[0] * grid[1] * grid[2]}
        try:
            row["us"] = replay_microseconds(launch, **TIMING) / LAYERS
            got = outs[0].sum(0).double()
            row["error"] = ((got - exact).norm() / exact.norm()).item()
        except Exception as error:  # one failing setting must not hide the others' numbers
            row["failed"] = error_line(error)
        results.append(row)
        print(row, flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: the settings and the table only (no Triton kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    results = run(device) if device.type == "cuda" and triton is not None else []
    lines = [
        f"Device: {device_name(device)} | {utc_now()} | torch {torch.__version__} | x ({ROWS}, {FEATURES}) bf16 @ A.T "
        f"({RANKS}, {FEATURES}) float32 weights, {LAYERS} layers in one CUDA graph | microseconds a layer; feature "
        "splits > 1: partial sums only (no merge); error: relative to float64 products of the float32 weights",
        "",
        "| mode | BLOCK_M, BLOCK_R, BLOCK_K, warps, stages | feature splits | programs | us a layer | error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in results:
        head = f"| {MODES[row['mode']]} | {', '.join(str(v) for v in row['setting'][:5])} | {row['setting'][5]} | "
        if "failed" in row:
            lines.append(f"{head}{row['programs']} | failed: {row['failed']} | |")
            continue
        lines.append(f"{head}{row['programs']} | {row['us']:.2f} | {row['error']:.1e} |")
    if not results:
        settings = settings_for(FEATURES)
        lines.append(f"(no CUDA with Triton here: {len(MODES)} modes x {len(settings)} settings not run)")
    publish("\n".join(lines) + "\n", args.out)
    return results


if __name__ == "__main__":
    main()
