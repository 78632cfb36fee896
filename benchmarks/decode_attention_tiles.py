"""The decode step's attention kernel (`decode_attention_triton._split_kernel`) at the recipe's cache lengths: its
launch settings against the bandwidth the live keys and values need.

Why: a decode step's other kernels read the weights once whatever the cache length, but attention reads every live
key and value of every row, so it grows through a generation. At the reset-4 shape (64 rows, Qwen2-0.5B's 2 KV heads
of 64, a 6,656-column cache) a step half-way through reads 2.8 GB of cache, more than twice the weights; the decode
limit of `generation.py` counts it. This times 24 layers' attention (distinct caches, so L2 holds none of them) in
one CUDA graph at several live lengths, for each setting of the split kernel:

- `programs`: the split count aims at this many programs a launch (`decode_attention.TARGET_PROGRAMS`);
- `block`: keys per inner iteration (`BLOCK_N`); `warps`; `stages`: Triton's pipelining depth of the inner loop
  (`-`: Triton's default).

Each setting's output is checked against `gqa_decode_attention_reference` at the longest length. GB/s counts the live
keys and values read (bf16), the bytes attention cannot avoid.

    python benchmarks/decode_attention_tiles.py --rows 64 --cache-len 6656 --live 600,3584,6144 --out r.md  # CUDA
    python benchmarks/decode_attention_tiles.py --smoke                                                     # CPU
"""

from __future__ import annotations

import argparse
import itertools

from _common import device_name, error_line, publish, replay_microseconds, utc_now  # first: the repository on sys.path

import torch  # noqa: E402

from prorl_trl.rollout import decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B
LAYERS = 24
TIMING = {"samples": 10, "warm_replay": True}


def build(rows: int, cache_len: int, layers: int, device, dtype):
    """Per layer a query and its own key and value caches (random), and the rows' first live column (0)."""
    queries = [torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(layers)]
    caches = [
        tuple(torch.randn(rows, KV_HEADS, cache_len, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
        for _ in range(layers)
    ]
    start = torch.zeros(rows, dtype=torch.long, device=device)
    return queries, caches, start


def settings_grid(programs: str, blocks: str, warps: str, stages: str) -> list[dict]:
    """Every combination of the comma-separated values; the engine's own setting first."""
    default = {
        "programs": decode_attention.TARGET_PROGRAMS, "block": decode_attention.BLOCK_N,
        "warps": decode_attention.NUM_WARPS, "stages": None,
    }  # fmt: skip

    def values(text: str, none_ok: bool = False) -> list:
        return [None if none_ok and v.strip() == "-" else int(v) for v in text.split(",") if v.strip()]

    grid = [
        {"programs": p, "block": b, "warps": w, "stages": s}
        for p, b, w, s in itertools.product(values(programs), values(blocks), values(warps), values(stages, True))
    ]
    return [default] + [setting for setting in grid if setting != default]


def attend(setting: dict, query, caches, start, end, scale):
    """One layer's attention with `setting` (the Triton kernel on CUDA, the reference elsewhere)."""
    key_cache, value_cache = caches
    if not decode_attention.kernel_supports(query, key_cache):
        return decode_attention.gqa_decode_attention_reference(query, key_cache, value_cache, start, end, scale)
    from prorl_trl.rollout.decode_attention_triton import launch_gqa_decode

    rows, kv_heads, cache_len, _ = key_cache.shape
    split = decode_attention.split_size(rows, kv_heads, cache_len, setting["programs"], setting["block"])
    return launch_gqa_decode(query, key_cache, value_cache, start, end, scale, split, setting["block"],
                             decode_attention.LIVE_SPLITS, setting["warps"], setting["stages"])  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cache-len", type=int, default=6656)
    parser.add_argument("--live", default="600,3584,6144", help="live keys per row, comma separated")
    parser.add_argument("--programs", default="512,1024,2048")
    parser.add_argument("--blocks", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="-,2,4", help="'-': Triton's default")
    parser.add_argument("--smoke", action="store_true", help="CPU, the reference on a small cache")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, cache_len, layers = (args.rows, args.cache_len, LAYERS) if device.type == "cuda" else (2, 256, 2)
    lives = sorted({min(int(v), cache_len) for v in args.live.split(",") if v.strip()})
    settings = settings_grid(args.programs, args.blocks, args.warps, args.stages)
    if device.type == "cpu":
        settings = settings[:1]
    queries, caches, start = build(rows, cache_len, layers, device, dtype)
    scale = HEAD_DIM**-0.5
    ends = {live: torch.tensor(live - 1, device=device) for live in lives}
    longest = max(lives)
    want = decode_attention.gqa_decode_attention_reference(queries[0], *caches[0], start, ends[longest], scale)
    results = []
    for setting in settings:
        row = dict(setting)
        try:
            got = attend(setting, queries[0], caches[0], start, ends[longest], scale)
            row["max_error"] = (got.float() - want.float()).abs().max().item()
            for live in lives:
                end = ends[live]

                def launch():
                    for query, cache in zip(queries, caches):
                        attend(setting, query, cache, start, end, scale)

                row[live] = replay_microseconds(launch, **TIMING) / layers
        except Exception as error:  # one failing setting must not hide the others' numbers
            row["error"] = error_line(error)
        results.append(row)
        print(row, flush=True)
    kv_bytes = rows * KV_HEADS * HEAD_DIM * 2 * torch.finfo(dtype).bits // 8  # a live column's keys and values
    lines = [
        f"Device: {device_name(device)} | {utc_now()} | torch {torch.__version__} | {rows} rows x {HEADS} heads "
        f"({KV_HEADS} KV heads of {HEAD_DIM}), cache {cache_len} columns, {layers} layers with their own caches | "
        "microseconds a layer (GB/s of live keys and values), CUDA-graph replays; the first row is the engine's "
        "setting",
        "",
        "| programs | block | warps | stages | " + " | ".join(f"{live} live" for live in lives) + " | max error |",
        "|---:|---:|---:|---:|" + "---:|" * len(lives) + "---:|",
    ]
    for row in results:
        head = f"| {row['programs']} | {row['block']} | {row['warps']} | {row['stages'] or '-'} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error']} |")
            continue
        cells = " | ".join(f"{row[live]:.2f} ({kv_bytes * live / row[live] / 1e3:.0f})" for live in lives)
        lines.append(f"{head} {cells} | {row['max_error']:.1e} |")
    publish("\n".join(lines) + "\n", args.out)
    return results


if __name__ == "__main__":
    main()
