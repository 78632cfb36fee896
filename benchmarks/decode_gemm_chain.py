"""The decode step's projections at 32 rows as a chain of kernels: cuBLAS against a Triton GEMM with programmatic
dependent launch (PDL), the weights fetched before the wait.

Why: at the seed's Initial shape (32 rows) the q/k/v, o, gate/up and down GEMMs took 719 of a step's 1,294 us of
kernel time on an H100 (profile of commit d6ff7ca, benchmarks/results/rollout_engine.md), about 28 % of the
bandwidth their 29.7 MB a layer need: each is a short kernel that waits for its input before reading any weight. A
kernel launched with PDL starts while the previous kernel runs and may read what no running kernel writes (the
weights) before `griddepcontrol.wait`; only the activations wait. This times 24 layers of the four projections
(distinct weights, each input the previous output, as in a decode step) in one CUDA graph:

- `cublas`: `torch.mm` (the cuBLAS GEMMs the engine's compiled step calls);
- `triton`: one Triton program per (column tile, K slice), no PDL;
- `triton_pdl`: the same launched with PDL, waiting before any load;
- `triton_pdl_preload`: with PDL, the program's weight tile loaded into registers before the wait;
- `triton_pdl_l2`: with PDL, the weight tile's cache lines prefetched into L2 before the wait, loaded after it.

K slices (split-K) merge in a fixed order in the last program of a column tile to arrive (an arrival counter), so
the result does not depend on which program merges. Each variant's output is checked against float32 products.
Measured on an H200 (2026-11-30, benchmarks/results/rollout_engine.md): cuBLAS 23.6 us a layer at 32 rows, the best
Triton variant (weights into registers before the wait) 28.6; none of these kernels went into the engine.

    python benchmarks/decode_gemm_chain.py --out results.md     # CUDA
    python benchmarks/decode_gemm_chain.py --smoke              # CPU: the torch chain on small shapes
"""

from __future__ import annotations

import argparse

from _common import device_name, error_line, publish, replay_microseconds, utc_now  # first: the repository on sys.path

import torch  # noqa: E402

HIDDEN, INTERMEDIATE, QKV = 896, 4864, 1152 + 64  # Qwen2-0.5B; q/k/v with r32 q,k A rows folded in (the Initial)
LAYERS = 24
PROJECTIONS = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
TILES = {  # BLOCK_N, K_SLICE, num_warps: about one program or two per H100/H200 SM
    "qkv": (16, 512, 4),
    "o": (16, 512, 4),
    "gate_up": (32, 1024, 8),
    "down": (32, 512, 4),
}
MODES = {"triton": 0, "triton_pdl": 1, "triton_pdl_preload": 2, "triton_pdl_l2": 3}
TIMING = {"samples": 20, "warm_replay": True}  # `_common.replay_microseconds`: one chain a graph, 20 replays timed


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton: --smoke runs cuBLAS's stand-in (torch) only
    triton = None

if triton is not None:

    @triton.jit
    def _prefetch_l2(pointers):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _skinny_kernel(
        X, W, Out, Partial, Arrivals, M, stride_x,
        N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_SLICE: tl.constexpr,
        SPLITS: tl.constexpr, MODE: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        part = tl.program_id(1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = part * K_SLICE + tl.arange(0, K_SLICE)
        rows = tl.arange(0, BLOCK_M)
        w_pointers = W + cols[:, None] * K + ks[None, :]
        w_mask = (cols < N)[:, None] & (ks < K)[None, :]
        if MODE == 2:
            w = tl.load(w_pointers, mask=w_mask, other=0.0)
            tl.extra.cuda.gdc_wait()
        elif MODE == 3:
            lines = part * K_SLICE + tl.arange(0, K_SLICE // 64) * 64  # 64 bf16 = one 128-byte line
            line_pointers = W + cols[:, None] * K + lines[None, :]
            _prefetch_l2(tl.where((cols < N)[:, None] & (lines < K)[None, :], line_pointers, W))
            tl.extra.cuda.gdc_wait()
            w = tl.load(w_pointers, mask=w_mask, other=0.0)
        elif MODE == 1:
            tl.extra.cuda.gdc_wait()
            w = tl.load(w_pointers, mask=w_mask, other=0.0)
        else:
            w = tl.load(w_pointers, mask=w_mask, other=0.0)
        if MODE > 0:
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w))
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        if SPLITS == 1:
            tl.store(Out + rows[:, None] * N + cols[None, :], acc.to(Out.dtype.element_ty), mask=inside)
        else:
            tl.store(Partial + (part * BLOCK_M + rows)[:, None] * N + cols[None, :], acc, mask=inside)
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the last slice of this column tile: every other slice's partial is written
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for other in range(SPLITS):
                    total += tl.load(Partial + (other * BLOCK_M + rows)[:, None] * N + cols[None, :], mask=inside,
                                     other=0.0, cache_modifier=".cg")  # fmt: skip
                tl.store(Out + rows[:, None] * N + cols[None, :], total.to(Out.dtype.element_ty), mask=inside)
                tl.atomic_xchg(Arrivals + tile, 0)


class TritonLinear:
    """`x @ weight.T` for one projection shape: the output, split-K partials and arrival counters allocated once."""

    def __init__(self, name: str, rows: int, device: torch.device, mode: int):
        out_features, in_features = PROJECTIONS[name]
        self.block_n, self.k_slice, self.num_warps = TILES[name]
        self.splits = triton.cdiv(in_features, self.k_slice)
        self.tiles = triton.cdiv(out_features, self.block_n)
        self.block_m = max(16, triton.next_power_of_2(rows))
        self.mode, self.n, self.k = mode, out_features, in_features
        self.partial = torch.empty(self.splits * self.block_m, out_features, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(self.tiles, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        _skinny_kernel[(self.tiles, self.splits)](
            x, weight, out, self.partial, self.arrivals, x.shape[0], x.stride(0),
            N=self.n, K=self.k, BLOCK_M=self.block_m, BLOCK_N=self.block_n, K_SLICE=self.k_slice,
            SPLITS=self.splits, MODE=self.mode, num_warps=self.num_warps, launch_pdl=self.mode > 0,
        )  # fmt: skip
        return out


def build(rows: int, device: torch.device, dtype: torch.dtype, layers: int, scale: int = 1):
    """Per layer: the four weights (distinct, so nothing stays in L2 from one layer to the next) and outputs."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    weights, outputs = [], []
    for _ in range(layers):
        layer, outs = {}, {}
        for name, (out_features, in_features) in PROJECTIONS.items():
            shape = (out_features // scale, in_features // scale)
            layer[name] = (torch.randn(shape, generator=generator) / shape[1] ** 0.5).to(device, dtype)
            outs[name] = torch.empty(rows, shape[0], dtype=dtype, device=device)
        weights.append(layer)
        outputs.append(outs)
    x = torch.randn(rows, HIDDEN // scale, generator=generator).to(device, dtype)
    return x, weights, outputs


def chain(x, weights, outputs, linear, only: str | None = None):
    """The layers' projections in order, each input a slice of the previous output. `only`: that projection alone in
    every layer, reading a fixed input of its width (the launches still run one after another)."""
    if only is not None:
        source = fixed_input(x, weights[0][only].shape[1])
        return [linear(only, source, layer[only], outs[only])
                for layer, outs in zip(weights, outputs)]  # fmt: skip
    hidden = x
    for layer, outs in zip(weights, outputs):
        for name in PROJECTIONS:
            hidden = linear(name, hidden[:, : layer[name].shape[1]], layer[name], outs[name])
    return hidden


_FIXED: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def fixed_input(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` repeated to `width` columns, made on first use (before capture: `replay_microseconds` runs once eagerly)
    and reused, so a captured graph holds only the GEMMs. The cache holds `x` too, so its `id` keys no other tensor
    (a freed tensor's address, the key before, could be another input's)."""
    key = (id(x), width)
    if key not in _FIXED:
        _FIXED[key] = (x, x.repeat(1, -(-width // x.shape[1]))[:, :width].contiguous())
    return _FIXED[key][1]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--methods", default="cublas," + ",".join(MODES))
    parser.add_argument("--smoke", action="store_true", help="CPU, torch ops on small shapes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    methods = ["cublas"] if device.type == "cpu" else [m.strip() for m in args.methods.split(",") if m.strip()]
    layers = LAYERS if device.type == "cuda" else 2
    x, weights, outputs = build(args.rows, device, dtype, layers, scale=1 if device.type == "cuda" else 16)
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer.values()) / layers
    reference = {}  # float32 products of the same inputs, projection by projection
    rows_out = []
    for method in methods:
        if method == "cublas":
            linear = lambda name, source, weight, out: torch.mm(source, weight.T, out=out)  # noqa: E731
        else:
            kernels = {name: TritonLinear(name, args.rows, device, MODES[method]) for name in PROJECTIONS}
            linear = lambda name, source, weight, out: kernels[name](source, weight, out)  # noqa: E731
        row = {"method": method}
        try:
            errors = []
            for name in PROJECTIONS:  # one layer's projection against float32 math
                width = weights[0][name].shape[1]
                source = fixed_input(x, width)
                got = linear(name, source, weights[0][name], outputs[0][name]).float()
                want = reference.setdefault(name, source.float() @ weights[0][name].float().T)
                errors.append(((got - want).abs().max() / want.abs().max()).item())
            row["max_relative_error"] = max(errors)
            row["us_per_layer"] = replay_microseconds(lambda: chain(x, weights, outputs, linear), **TIMING) / layers
            for name in PROJECTIONS:
                alone = replay_microseconds(lambda: chain(x, weights, outputs, linear, only=name), **TIMING)
                row[name] = alone / layers
        except Exception as error:  # one failing variant must not hide the others' numbers
            row["error"] = error_line(error)
        rows_out.append(row)
        print(row, flush=True)
    lines = [
        f"Device: {device_name(device)} | {utc_now()} | torch {torch.__version__} | {args.rows} rows, {layers} layers, "
        f"{weight_bytes / 1e6:.1f} MB of weights a layer | microseconds a layer, CUDA-graph replays",
        "",
        "| method | all four | GB/s | " + " | ".join(PROJECTIONS) + " | max relative error |",
        "|---|---:|---:|" + "---:|" * len(PROJECTIONS) + "---:|",
    ]
    for row in rows_out:
        if "error" in row:
            lines.append(f"| {row['method']} | failed: {row['error']} |")
            continue
        cells = " | ".join(f"{row[name]:.2f}" for name in PROJECTIONS)
        bandwidth = weight_bytes / row["us_per_layer"] / 1e3
        lines.append(f"| {row['method']} | {row['us_per_layer']:.2f} | {bandwidth:.0f} | "
                     f"{cells} | {row['max_relative_error']:.1e} |")  # fmt: skip
    publish("\n".join(lines) + "\n", args.out)
    return rows_out


if __name__ == "__main__":
    main()
