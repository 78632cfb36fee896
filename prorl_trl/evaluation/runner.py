"""Sample one model over a problem set into a resumable per-model samples file, then grade.

`<out>/samples/<model>.jsonl` gets one line per completion as soon as its batch is done, so an interrupted run
(or a run with a larger `--n` or `--limit`) only draws what is missing. `<model>.meta.json` records the sampling
settings; resuming with different ones is refused, because mixing them would make pass@k meaningless.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sampling import Completion, SamplingSettings, encode_prompt, sample_transformers, sample_vllm, vllm_available

# Settings that change what a sample means (the seed too: stored samples are not redrawn under a new one, so a run
# with another seed would report the old seed's draws). `num_samples` and `batch_size` may differ between runs.
_RESUME_KEYS = ("temperature", "top_p", "max_completion_length", "seed")


@dataclass
class ModelSpec:
    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """`NAME=PATH`, or a bare `PATH` (named after its last path component)."""
        name, sep, path = text.partition("=")
        if not sep:
            name, path = Path(text.rstrip("/")).name, text
        if not name or not path:
            raise ValueError(f"--model {text!r}: expected NAME=PATH (e.g. base=Qwen/Qwen2.5-0.5B).")
        if any(ch in name for ch in "/\\:") or name.startswith("."):
            raise ValueError(f"--model {text!r}: the name {name!r} must not contain '/', '\\' or ':' (it names files).")
        return cls(name, path)


def prompt_sha(ids: list[int]) -> str:
    """A short fingerprint of a tokenised prompt, to notice stored samples of another prompt or chat template."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def samples_file(out_dir: str | Path, name: str) -> Path:
    return Path(out_dir) / "samples" / f"{name}.jsonl"


def read_samples(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Existing samples keyed by (problem_id, sample_index); a truncated last line (a killed run) is skipped."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    if not path.exists():
        return found
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            found[(str(record["problem_id"]), int(record["sample_index"]))] = record
    return found


def end_with_newline(path: Path) -> None:
    """Make `path` end with a newline before records are appended to it.

    A run killed mid-write leaves a last line without its newline. `read_samples` skipped it if it is not valid JSON:
    it is cut off (else the next record would be glued onto it and lost too); a complete record just gets its newline.
    """
    if not path.exists():
        return
    with open(path, "rb+") as handle:
        size = handle.seek(0, 2)
        if size == 0:
            return
        keep, position = 0, size
        while position > 0:  # scan backwards in blocks for the last newline (samples files can be large)
            start = max(0, position - 65536)
            handle.seek(start)
            newline = handle.read(position - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        if keep == size:
            return
        handle.seek(keep)
        try:
            json.loads(handle.read(size - keep))
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            handle.truncate(keep)
        else:
            handle.seek(size)
            handle.write(b"\n")


def _meta(spec: ModelSpec, settings: SamplingSettings) -> dict[str, Any]:
    return {"model": spec.path, **{k: getattr(settings, k) for k in _RESUME_KEYS}}


class SampledWithOtherSettings(ValueError):
    """Stored samples were drawn with other settings (a bad input: the command exits 2, nothing is sampled)."""


def check_resumable(out_dir: str | Path, specs: list[ModelSpec], settings: SamplingSettings) -> None:
    """Refuse early (before loading anything) when stored samples were drawn with other settings."""
    for spec in specs:
        _check_meta(samples_file(out_dir, spec.name).with_suffix(".meta.json"), _meta(spec, settings), spec.name, write=False)


def _check_meta(meta_path: Path, meta: dict[str, Any], name: str, write: bool = True) -> None:
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        changed = [k for k in _RESUME_KEYS + ("model",) if k in old and old[k] != meta[k]]
        if changed:
            diff = ", ".join(f"{k}: {old[k]!r} -> {meta[k]!r}" for k in changed)
            raise SampledWithOtherSettings(
                f"{meta_path.parent / (name + '.jsonl')} was sampled with other settings ({diff}); "
                "use another --out, or delete that file to resample."
            )
    if not write:
        return
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(meta, indent=2))


def load_model(path: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False):
    """`(model, tokenizer)` in eval mode on `device` ("auto": cuda if available); dtype "auto": bf16 on GPU, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer


def _free_accelerator_memory() -> None:
    """Release the finished model's GPU memory before the next model loads (several models run in one process)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu.")
    return device


def sample_model(
    spec: ModelSpec,
    problems: list[dict[str, Any]],
    settings: SamplingSettings,
    out_dir: str | Path,
    backend: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """All `settings.num_samples` samples of every problem (read back or drawn), and the throughput of new ones.

    The model is loaded only when something is missing, so re-reporting a finished run is cheap.
    """
    path = samples_file(out_dir, spec.name)
    _check_meta(path.with_suffix(".meta.json"), _meta(spec, settings), spec.name)
    existing = read_samples(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=trust_remote_code)
    encoded = [encode_prompt(p["prompt"], tokenizer) for p in problems]
    shas = {p["problem_id"]: prompt_sha(ids) for p, ids in zip(problems, encoded)}
    stale = sorted({pid for (pid, _), r in existing.items() if pid in shas and r.get("prompt_sha", shas[pid]) != shas[pid]})
    if stale:
        raise ValueError(
            f"{path}: the stored samples of problems {stale[:5]} were drawn from other prompts (dataset or chat "
            "template changed); use another --out, or delete that file to resample."
        )
    wanted = {(p["problem_id"], s) for p in problems for s in range(settings.num_samples)}
    missing = sorted(wanted - set(existing))
    stats: dict[str, Any] = {"completions": 0, "completion_tokens": 0, "seconds": 0.0, "backend": "none"}
    if missing:
        if backend == "auto":
            backend = "vllm" if vllm_available() and resolve_device(device).startswith("cuda") else "transformers"
        if backend not in ("transformers", "vllm"):
            raise ValueError(f"--backend {backend!r}: choose auto, transformers or vllm.")
        stats["backend"] = backend
        position = {p["problem_id"]: i for i, p in enumerate(problems)}
        path.parent.mkdir(parents=True, exist_ok=True)
        end_with_newline(path)
        with open(path, "a", encoding="utf-8") as handle:

            def append(batch: list[Completion]) -> None:
                for c in batch:
                    pid = problems[c.prompt_index]["problem_id"]
                    if (pid, c.sample_index) in existing:
                        continue
                    record = {
                        "problem_id": pid, "sample_index": c.sample_index, "completion": c.text,
                        "num_tokens": c.num_tokens, "finished": c.finished, "prompt_sha": shas[pid],
                    }
                    existing[(pid, c.sample_index)] = record
                    handle.write(json.dumps(record) + "\n")
                handle.flush()

            if backend == "transformers":
                model, tokenizer = load_model(spec.path, device, dtype, trust_remote_code)
                jobs = [(position[pid], s) for pid, s in missing]
                _, new = sample_transformers(
                    model, tokenizer, encoded, settings, jobs=jobs, on_batch=append,
                    progress=progress, desc=f"sampling {spec.name}",
                )
                del model
                _free_accelerator_memory()
            else:
                indices = sorted({position[pid] for pid, _ in missing})
                completions, new = sample_vllm(spec.path, encoded, settings, indices, dtype, trust_remote_code)
                append(completions)
        stats.update(new)
    records = [existing[key] for key in sorted(wanted)]
    return records, stats
