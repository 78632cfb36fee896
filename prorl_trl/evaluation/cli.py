"""`prorl-trl eval`: sample n completions per problem per model, grade with the reward registry, report pass@k.

`prorl_trl.cli` wires `add_eval_arguments` / `run_eval` as the `eval` subcommand; `python -m prorl_trl.evaluation.cli`
runs it standalone. Arguments are checked before any model is loaded and before `--out` is created (the dataset is
read first only where a check needs its columns: `--breakdown`, empty subsets); bad ones exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..data.builders import is_local_source
from .grading import DEFAULT_REWARDS, resolve_reward
from .problems import DATASETS, check_breakdown, load_rows, select, with_problem_ids
from .runner import ModelSpec, check_resumable
from .sampling import SamplingSettings, vllm_available


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="Model to evaluate (local dir or hub id); repeat for several models.")
    p.add_argument("--dataset", required=True, choices=DATASETS, help="Problem set (rows with a prompt and gold columns).")
    p.add_argument("--data-files", default=None, metavar="PATH",
                   help="Local file or folder (or hub id) to read instead of the builder's hub data set; "
                        "required for --dataset jsonl.")
    p.add_argument("--split", default="test", help="Split to evaluate (a folder source reads <folder>/<split>.jsonl).")
    p.add_argument("--columns", default="", metavar="OURS=THEIRS,...",
                   help="Column mapping for --dataset jsonl, e.g. prompt=question,answer=final.")
    p.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE",
                   help="Builder option, e.g. num_people=3 for kk; repeatable.")
    p.add_argument("--template", default=None, help="Prompt template (prorl_trl.data.templates); default: the builder's.")
    p.add_argument("--prompt-format", default="chat", choices=["chat", "plain"],
                   help="chat: messages rendered by the model's chat template; plain: one string (base models).")
    p.add_argument("--limit", type=int, default=None, help="Evaluate only the first N problems (after --subset non-integer).")
    p.add_argument("--n", type=int, default=32, help="Completions sampled per problem.")
    p.add_argument("--k", default="1,2,4,8,16,32", help="Comma-separated k values of pass@k (each <= --n).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    p.add_argument("--top-p", type=float, default=0.7, help="Nucleus sampling mass (1.0: off).")
    p.add_argument("--max-new-tokens", "--max-completion-length", type=int, default=1024,
                   help="Maximum new tokens per completion (distill's and the recipes' max_completion_length).")
    p.add_argument("--batch-size", type=int, default=None, help="Sequences per generate call (default: 256 on GPU, 32 on CPU).")
    p.add_argument("--breakdown", default="", help="Comma-separated columns to break pass@k down by (e.g. level,subject).")
    p.add_argument("--subset", default=None, metavar="non-integer|always-wrong:NAME",
                   help="non-integer: problems whose gold answer is not an integer; always-wrong:NAME: problems model "
                        "NAME got wrong in all n samples (the others are sampled on those only).")
    p.add_argument("--reward", default=None, help="Registry reward that grades (default per dataset: "
                   + ", ".join(f"{d}: {r}" for d, r in DEFAULT_REWARDS.items()) + ").")
    p.add_argument("--out", required=True, help="Output directory (re-running with it resumes sampling).")
    p.add_argument("--seed", type=int, default=0, help="Seed of sampling and of the bootstrap.")
    p.add_argument("--num-resamples", type=int, default=1000, help="Bootstrap resamples of the problems.")
    p.add_argument("--confidence", type=float, default=0.95, help="Bootstrap interval coverage.")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="Model dtype (auto: bfloat16 on GPU, float32 on CPU).")
    p.add_argument("--backend", default="auto", choices=["auto", "transformers", "vllm"],
                   help="auto: vLLM when importable and on GPU, else transformers generate.")
    p.add_argument("--compile", action="store_true",
                   help="transformers backend on GPU: static KV cache + compiled decode step (several times faster "
                        "for small models; the first batch pays the compilation).")
    p.add_argument("--rollout-engine", default="auto", choices=["auto", "on", "off"],
                   help="transformers backend: sample with prorl_trl.rollout's CUDA-graph decode loop (auto: on CUDA); "
                        "settings it does not implement fall back to generate.")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is fastest for small models on a busy machine).")
    p.add_argument("--trust-remote-code", action="store_true", help="Allow model repos' own code (off by default).")
    p.add_argument("--no-plots", action="store_true", help="Skip the PNG plots (no matplotlib needed).")
    p.add_argument("--no-progress", action="store_true", help="No progress bars.")
    return p


def _parse(args: argparse.Namespace) -> dict[str, Any]:
    """Check and normalise every argument; raises ValueError with a message for the user."""
    models = [ModelSpec.parse(text) for text in args.model]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"--model names must be unique, got {names}; write NAME=PATH with distinct names.")
    for model in models:  # a typo in a local path would otherwise surface as a hub error after sampling started
        if is_local_source(model.path) and not Path(model.path).expanduser().exists():
            raise ValueError(f"--model {model.name}={model.path}: local model folder not found.")
    try:
        ks = sorted({int(k) for k in str(args.k).split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--k {args.k!r}: expected comma-separated integers such as 1,2,4,8.") from None
    if not ks or ks[0] < 1:
        raise ValueError(f"--k {args.k!r}: every k must be >= 1.")
    if ks[-1] > args.n:
        raise ValueError(f"--k asks for pass@{ks[-1]} but --n is {args.n}: sample at least as many completions as the largest k.")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}.")
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1), got {args.confidence}.")
    reference = None
    if args.subset is not None:
        if args.subset.startswith("always-wrong:"):
            reference = args.subset.split(":", 1)[1]
            if reference not in names:
                raise ValueError(f"--subset {args.subset}: {reference!r} is not one of the --model names {names}.")
            if len(models) < 2:
                raise ValueError("--subset always-wrong:NAME compares models: give at least one other --model.")
        elif args.subset != "non-integer":
            raise ValueError(f"--subset {args.subset!r}: expected 'non-integer' or 'always-wrong:NAME'.")
    if args.dataset == "jsonl" and not args.data_files:
        raise ValueError("--dataset jsonl needs --data-files FILE.jsonl and --columns prompt=<column>,answer=<column>.")
    columns = _pairs(args.columns.split(",") if args.columns else [], "--columns")
    options = {k: _number(v) for k, v in _pairs(args.data_option, "--data-option").items()}
    if args.backend == "vllm" and not vllm_available():
        raise ValueError("--backend vllm: vLLM is not importable here; install the `vllm` extra or use --backend transformers.")
    import torch

    from .runner import resolve_device

    resolve_device(args.device)  # `--device cuda` without CUDA: exit 2 here, not a traceback once sampling starts
    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    batch_size = args.batch_size if args.batch_size is not None else 256 if on_cuda else 32
    settings = SamplingSettings(
        num_samples=args.n, temperature=args.temperature, top_p=args.top_p,
        max_completion_length=args.max_new_tokens, batch_size=batch_size, seed=args.seed, compile=args.compile,
        rollout_engine=args.rollout_engine == "on" or (args.rollout_engine == "auto" and on_cuda),
    )
    reward = resolve_reward(args.reward or DEFAULT_REWARDS[args.dataset])
    breakdown = [f.strip() for f in args.breakdown.split(",") if f.strip()]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory.")
    stored = [*(out / "samples").glob("*.jsonl"), *(out / "samples").glob("*.meta.json")]  # an evaluation's samples
    if out.is_dir() and any(out.iterdir()) and not stored:
        raise ValueError(  # its report.md, summary.* and plots would be written over a user's files of those names
            f"--out {out} is not empty and holds no evaluation (no samples/*.jsonl): nothing was written. "
            "Choose a new or empty folder, or the --out of an earlier evaluation to add to it."
        )
    return {"models": models, "ks": ks, "reference": reference, "settings": settings, "reward": reward,
            "breakdown": breakdown, "out": out, "columns": columns, "options": options}


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE.")
        pairs[key.strip()] = value.strip()
    return pairs


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run_eval(args: argparse.Namespace) -> int:
    """The `eval` subcommand; returns the exit status (2 for bad arguments, before any work)."""
    try:
        opts = _parse(args)
        columns, options = opts.pop("columns"), opts.pop("options")
        source = (args.dataset, args.data_files, args.split, columns, options, args.template, args.prompt_format)
        rows = load_rows(*source, reward_funcs=[opts["reward"]])  # its gold columns are checked before any sampling
        rows = select(with_problem_ids(rows), "non-integer" if args.subset == "non-integer" else None, args.limit)
        if not rows:
            raise ValueError(f"No problems left in {args.dataset} after --subset/--limit; nothing to evaluate.")
        check_breakdown(rows, opts["breakdown"])
        check_resumable(opts["out"], opts["models"], opts["settings"])
    except (ValueError, FileNotFoundError) as error:
        print(f"prorl-trl eval: error: {error}", file=sys.stderr)
        return 2
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(max(1, args.num_threads))
    from .evaluate import evaluate

    evaluate(rows, **opts, dataset=args.dataset, device=args.device, dtype=args.dtype, backend=args.backend,
             trust_remote_code=args.trust_remote_code, num_resamples=args.num_resamples, confidence=args.confidence,
             plots=not args.no_plots, progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_eval_arguments(argparse.ArgumentParser(prog="prorl-trl eval", description=__doc__))
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
