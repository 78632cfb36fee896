"""What every benchmark shares: the repository on `sys.path` with the Hub offline, the device's name, a table
header's date and package versions, number cells, command-line integer lists, printing a table (and its JSON) and
joining saved runs.

Importing this module sets the environment up, so each script imports it first and then runs the same from
`python benchmarks/X.py`, from `accelerate launch` and from a test: this checkout's `prorl_trl` wins over an
installed one, and nothing reaches the Hub (the benchmarks build random-weight models).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
DEFAULT_RECIPE = ROOT / "recipes" / "prorl_gsm8k_qwen2_0.5b.yaml"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
for _path in (str(BENCHMARKS), str(ROOT)):  # ROOT ends first: this checkout's package before an installed copy
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)


def device_name(device=None, cpu: str = "CPU") -> str:
    """The GPU's name (`NVIDIA H200`) for a CUDA device (default: the current one where CUDA is present), else `cpu`:
    every table names the card it ran on, since figures move between an H100 and an H200."""
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu


def cpu_name() -> str:
    """The CPU's model name (lscpu's), for tables measured on CPU: reward rates depend on the core."""
    import platform
    import subprocess

    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in output.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def utc_now() -> str:
    """The date and minute a table was measured, in UTC (results files cite runs by date)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def versions(*names: str) -> str:
    """`torch 2.11.0, trl 1.16.0`: the installed version of each package, `-` for one not installed."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    """A number cell: `value` formatted with `spec`, or `none` where nothing was measured."""
    return none if value is None else format(value, spec)


def synchronize(device) -> None:
    """Wait for the GPU's queued work, so a wall-clock time covers it (nothing to wait for on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def int_list(text: str) -> list[int]:
    """Comma-separated integers (blanks skipped): a command-line list such as `--rows 32,64`."""
    return [int(value) for value in text.split(",") if value.strip()]


def int_grid(*texts: str) -> list[tuple[int, ...]]:
    """Every combination of the comma-separated integer lists `texts`, in order: a tile script's settings grid."""
    return list(itertools.product(*(int_list(text) for text in texts)))


def error_line(error: BaseException) -> str:
    """An exception as one table cell: `Type: its first line` (200 characters at most), or its repr where it has no
    message (a bare `str(error).splitlines()[0]` raises on an empty message)."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text.strip() else repr(error)


def replay_microseconds(launch, launches: int = 1, samples: int = 5, warm_replay: bool = False) -> float:
    """Microseconds per `launch()`: called once eagerly, then `launches` calls captured in one CUDA graph (no warm-up
    work inside it), replayed `samples` times (after one untimed replay with `warm_replay`), the median; on CPU
    (smoke runs) the wall time of `launches` calls."""
    import statistics
    import time

    import torch

    if not torch.cuda.is_available():
        begin = time.perf_counter()
        for _ in range(launches):
            launch()
        return 1e6 * (time.perf_counter() - begin) / launches
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    if warm_replay:
        graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * begin.elapsed_time(end) / launches)
    return statistics.median(times)


def publish(report: str, out: Path | None = None, json_path: Path | None = None, payload=None) -> None:
    """Print a markdown report and write it to `out`; write `payload` as JSON to `json_path` (for `read_runs`)."""
    print(report, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report + "\n")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(payload, indent=1, default=str))


def read_runs(paths: list[Path]) -> list[dict]:
    """The JSON payloads of runs made apart (one per GPU call, say), to be joined into one table."""
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"{path}: not a benchmark's JSON output ({error}); pass the files its --json wrote.")
    return runs


# what transformers' enable_full_determinism sets in os.environ (`determinism_restored` puts it back)
DETERMINISM_ENVIRONMENT = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING",
                           "HCCL_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC")  # fmt: skip


@contextlib.contextmanager
def determinism_restored():
    """Put back the process-wide state that `full_determinism` (transformers' enable_full_determinism) switches:
    torch's deterministic algorithms, cuDNN's flags, SDPA's flash and memory-efficient kernels and the environment.
    Smoke runs and tests train in the caller's process, where that state would outlive the training."""
    import torch

    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())  # fmt: skip
    environment = {name: os.environ.get(name) for name in DETERMINISM_ENVIRONMENT}
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2:4]
        torch.backends.cuda.enable_flash_sdp(flags[4])
        torch.backends.cuda.enable_mem_efficient_sdp(flags[5])
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
