"""The sampler's race kernels (`race_triton`) at the Qwen2 vocabulary: their launch settings, microseconds a call.

Why: the race on the logits (sampling without top-p: the GSM8K recipe's reset-2 to reset-4) took 35 us a decode
step at 64 rows on an H200 (2026-11-30), reading 19 MB of bf16 logits: 0.55 TB/s, well under the bandwidth, with
arithmetic (a 32-bit hash and two logarithms a token) of about 12 us at the SMs' rate. This times both kernels, the
race after top-p on float32 probabilities (`launch_race`) and the race on the logits (`launch_logits_race`), for each
combination of programs a launch (`TARGET_PROGRAMS`), tokens per inner iteration (`BLOCK`, a divisor of
`top_p_triton.CHUNK_ALIGN`) and warps, in CUDA-graph replays of 10 calls, and checks that every setting draws the
same tokens as the engine's (the draw does not depend on the split: on equal keys the smaller token wins).

    python benchmarks/race_tiles.py --rows 32,64 --out r.md     # CUDA
    python benchmarks/race_tiles.py --smoke                     # CPU: the settings grid and the table, no kernel
"""

from __future__ import annotations

import argparse

from _common import device_name, error_line, int_grid, int_list, publish, replay_microseconds, utc_now  # first

import torch  # noqa: E402

from prorl_trl.rollout.decode_attention import triton_available  # noqa: E402

VOCAB = 151_936  # Qwen2
TIMING = {"launches": 10, "samples": 10, "warm_replay": True}


def settings_grid(programs: str, blocks: str, warps: str) -> list[tuple[int, int, int]]:
    """(programs, block, warps) combinations of the comma-separated values."""
    return int_grid(programs, blocks, warps)


def run(rows: int, settings: list[tuple[int, int, int]], device) -> list[dict]:
    """Each setting's microseconds a call of both kernels and whether it drew the engine setting's tokens."""
    from prorl_trl.rollout import race_triton
    from prorl_trl.rollout.sampler import race_winner, row_keys

    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, VOCAB, device=device, generator=generator) * 3).to(torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)
    tau = torch.full((rows, 1), 1e-6, device=device)
    temperature, eos = torch.tensor([1.2], device=device), torch.tensor([VOCAB - 293], device=device)
    too_early = torch.tensor([True], device=device)
    keys = row_keys(torch.tensor([3], device=device), torch.tensor([17], device=device), rows)
    calls = {
        "after top-p": lambda: race_triton.launch_race(probs, tau, keys),
        "on the logits": lambda: race_triton.launch_logits_race(logits, temperature, eos, too_early, keys),
    }
    engine = (race_triton.TARGET_PROGRAMS, race_triton.BLOCK, race_triton.NUM_WARPS)

    def tokens(call) -> torch.Tensor:
        return race_winner(*call())

    wanted = {name: tokens(call) for name, call in calls.items()}
    results = []
    for setting in [engine] + [s for s in settings if s != engine]:
        race_triton.TARGET_PROGRAMS, race_triton.BLOCK, race_triton.NUM_WARPS = setting
        row = {"rows": rows, "programs": setting[0], "block": setting[1], "warps": setting[2]}
        try:
            for name, call in calls.items():
                row[name] = replay_microseconds(call, **TIMING)
                row[name + " same"] = bool(torch.equal(tokens(call), wanted[name]))
        except Exception as error:  # one failing setting must not hide the others' numbers
            row["error"] = error_line(error)
        finally:
            race_triton.TARGET_PROGRAMS, race_triton.BLOCK, race_triton.NUM_WARPS = engine
        results.append(row)
        print(row, flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64", help="rows (sequences), comma separated")
    parser.add_argument("--programs", default="512,1024,2048,4096")
    parser.add_argument("--blocks", default="256,512,1024")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--smoke", action="store_true", help="CPU: the grid and the table only (no Triton kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    settings = settings_grid(args.programs, args.blocks, args.warps)
    results = []
    if device.type == "cuda" and triton_available():
        for rows in int_list(args.rows):
            results += run(rows, settings, device)
    lines = [
        f"Device: {device_name(device)} | {utc_now()} | torch {torch.__version__} | vocabulary {VOCAB:,}, bf16 logits "
        "(float32 probabilities for the race after top-p) | microseconds a call, CUDA-graph replays of 10 calls; "
        "per row count the first line is the engine's setting; same: the engine setting's tokens",
        "",
        "| rows | programs | block | warps | after top-p (us) | same | on the logits (us) | same |",
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in results:
        head = f"| {row['rows']} | {row['programs']} | {row['block']} | {row['warps']} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error']} |")
            continue
        lines.append(f"{head} {row['after top-p']:.2f} | {row['after top-p same']} | {row['on the logits']:.2f} | "
                     f"{row['on the logits same']} |")  # fmt: skip
    if not results:
        lines.append(f"(no CUDA with Triton here: {len(settings)} settings not run)")
    publish("\n".join(lines) + "\n", args.out)
    return results


if __name__ == "__main__":
    main()
