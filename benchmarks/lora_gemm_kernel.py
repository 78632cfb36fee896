"""GPU time of one decoder layer's LoRA products as the rollout engine runs them: reductions vs `lora_gemm` vs cuBLAS.

The decode step computes PEFT's LoRA products per layer in groups that share an input (q/k/v, o, gate/up, down:
`prorl_trl.rollout.lora_decode.project`). This times exactly that code for one layer of the Qwen2-0.5B architecture
(hidden 896, 2 KV heads of 64, MLP 4,864), compiled as the engine compiles it and replayed from a CUDA graph, with
float32 adapters and bf16 base outputs (views of one fused projection output, as the engine's are):
  reductions  `lora_gemm.MIN_ROWS = None`: inductor's broadcast-multiply-and-sum reductions (the engine's default)
  gemm        `lora_gemm.MIN_ROWS = 1`: the tiled Triton kernel, for each tiling in `--layouts`
  cublas      the same products as float32 `torch.matmul` (inductor calls cuBLAS; no TF32), epilogue fused by inductor
at the Initial phase (32 rows, r32 on q,k) and the seed's reset-4 shape (64 rows, r64 on all linear layers); every
path's outputs are checked against the reductions' (float32 rounding apart). Prints one markdown table.

    python benchmarks/lora_gemm_kernel.py                      # one GPU
    python benchmarks/lora_gemm_kernel.py --layouts 32:264:2,64:264:2,32:132:1,32:528:4
    python benchmarks/lora_gemm_kernel.py --smoke              # CPU, eager, no timing that means anything
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph_timing import replay_microseconds  # noqa: E402

from prorl_trl.rollout import lora_decode, lora_gemm  # noqa: E402
from prorl_trl.rollout.lora_decode import LoraFactors  # noqa: E402

HIDDEN, KV_WIDTH, MLP = 896, 128, 4864  # Qwen2-0.5B: q 896, k/v 2 x 64, gate/up/down 4,864
LAYERS = 24
OUT_FEATURES = {"q": HIDDEN, "k": KV_WIDTH, "v": KV_WIDTH, "o": HIDDEN, "gate": MLP, "up": MLP, "down": HIDDEN}
IN_FEATURES = {"q": HIDDEN, "k": HIDDEN, "v": HIDDEN, "o": HIDDEN, "gate": HIDDEN, "up": HIDDEN, "down": MLP}
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # projections that share an input
SHAPES = {  # name: (rows, rank, targets)
    "initial 32 rows r32 q,k": (32, 32, ("q", "k")),
    "reset-4 64 rows r64 all-linear": (64, 64, ("q", "k", "v", "o", "gate", "up", "down")),
}


def layer_inputs(rows: int, rank: int, targets: tuple[str, ...], device: torch.device) -> list[tuple]:
    """Per group with adapters: (input, factors, base outputs), random, the bases views of one fused output."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    groups = []
    for names in GROUPS:
        adapted = [name for name in names if name in targets]
        if not adapted:
            continue
        x = randn(rows, 1, IN_FEATURES[names[0]]).to(torch.bfloat16)
        factors = [LoraFactors(randn(rank, IN_FEATURES[n], scale=0.02), randn(OUT_FEATURES[n], rank, scale=0.02),
                               2.0) for n in adapted]  # fmt: skip
        fused = randn(rows, 1, sum(OUT_FEATURES[n] for n in adapted)).to(torch.bfloat16)
        bases = list(fused.split([OUT_FEATURES[n] for n in adapted], dim=-1))
        groups.append((x, factors, bases))
    return groups


def lora_products(groups: list[tuple]) -> list[torch.Tensor]:
    """What the decode step runs for one layer's adapters (`lora_decode._adapted` per group)."""
    return [out for x, factors, bases in groups for out in lora_decode._adapted(x, factors, bases)]


def cublas_products(groups: list[tuple]) -> list[torch.Tensor]:
    """The same function with float32 matmuls (cuBLAS under inductor)."""
    outputs = []
    for x, factors, bases in groups:
        rows = x.reshape(-1, x.shape[-1]).float()
        reduced = rows @ torch.cat([factor.down for factor in factors]).T
        offset = 0
        for factor, base in zip(factors, bases, strict=True):
            rank = factor.down.shape[0]
            delta = (reduced[:, offset : offset + rank] @ factor.up.T) * factor.scaling
            offset += rank
            outputs.append((base + delta.view(base.shape)).to(base.dtype))
    return outputs


@contextlib.contextmanager
def switches(min_rows: int | None, layout: tuple[int, int, int] | None):
    saved = lora_gemm.MIN_ROWS, lora_gemm.BLOCK_N, lora_gemm.TARGET_PROGRAMS, lora_gemm.MIN_SLICES_PER_SPLIT
    lora_gemm.MIN_ROWS = min_rows
    if layout is not None:
        lora_gemm.BLOCK_N, lora_gemm.TARGET_PROGRAMS, lora_gemm.MIN_SLICES_PER_SPLIT = layout
    try:
        yield
    finally:
        lora_gemm.MIN_ROWS, lora_gemm.BLOCK_N, lora_gemm.TARGET_PROGRAMS, lora_gemm.MIN_SLICES_PER_SPLIT = saved


def time_path(function, groups: list[tuple], replays: int, graphs: bool) -> tuple[float, list[torch.Tensor]]:
    """Microseconds per call (CUDA graph replays on a GPU; wall clock, eager, on CPU) and the outputs."""
    if not graphs:
        begin = time.perf_counter()
        outputs = function(groups)
        return 1e6 * (time.perf_counter() - begin), outputs
    compiled = torch.compile(function, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled(groups)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = compiled(groups)
    return replay_microseconds(graph, replays), [output.clone() for output in outputs]


def max_difference(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs, reference, strict=True))


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    layouts = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise SystemExit(f"--layouts: {item!r} is not BLOCK_N:TARGET_PROGRAMS:MIN_SLICES_PER_SPLIT (e.g. 32:264:2)")
        layouts.append(tuple(int(part) for part in parts))
    return layouts


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="32:264:2,64:264:2,32:132:1,32:528:4,16:264:2",
                        help="Kernel tilings to time, BLOCK_N:TARGET_PROGRAMS:MIN_SLICES_PER_SPLIT, comma-separated.")
    parser.add_argument("--replays", type=int, default=200, help="Graph replays per timing.")
    parser.add_argument("--smoke", action="store_true", help="CPU, eager: checks the script runs (timings meaningless).")
    args = parser.parse_args(argv)
    layouts = parse_layouts(args.layouts)
    graphs = not args.smoke
    if graphs and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke on CPU)")
    device = torch.device("cuda" if graphs else "cpu")
    name = torch.cuda.get_device_name() if graphs else "CPU (smoke)"
    print(f"{name}, torch {torch.__version__}: one layer's LoRA products, x {LAYERS} layers for a decode step")
    print("| shape | path | BLOCK_N:TARGET:MIN_SLICES | us per layer | ms per step (x24) | max abs diff vs reductions |")
    print("|---|---|---|---:|---:|---:|")
    rows = []
    for shape, (batch, rank, targets) in SHAPES.items():
        groups = layer_inputs(batch, rank, targets, device)
        with torch.no_grad():
            with switches(None, None):
                micros, reference = time_path(lora_products, groups, args.replays, graphs)
            runs = [("reductions", "-", micros, reference)]
            micros, outputs = time_path(cublas_products, groups, args.replays, graphs)
            runs.append(("cublas", "-", micros, outputs))
            for layout in layouts:
                with switches(1, layout):
                    torch._dynamo.reset()  # the tiling is read when the function is traced
                    micros, outputs = time_path(lora_products, groups, args.replays, graphs)
                runs.append(("gemm", ":".join(map(str, layout)), micros, outputs))
        for path, layout, micros, outputs in runs:
            difference = max_difference(outputs, reference)
            rows.append(dict(shape=shape, path=path, layout=layout, us=micros, difference=difference))
            print(f"| {shape} | {path} | {layout} | {micros:.1f} | {micros * LAYERS / 1000:.3f} | {difference:.1e} |")
    return rows


if __name__ == "__main__":
    main()
