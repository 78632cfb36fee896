"""One report from `prolonged.py` runs of separate calls: pack each call's runs for the record, gather them (issue 38).

    python benchmarks/prolonged_gather.py pack runs/r4L1 benchmarks/results/prolonged_runs/round4_lease3
    python benchmarks/prolonged_gather.py gather --out runs/round4 --warm-start WS16 \
        benchmarks/results/prolonged_runs/round4_lease3 benchmarks/results/prolonged_runs/round4_lease4 ...

Why: round 4's 30 runs take five GPU leases of 6 runs each, and its paired differences pair runs of different leases
(each knob arm against (c) of the same seed). A report over runs that did not share their settings would compare
different studies without saying so, so `gather` refuses, before it writes anything:
- sources whose study settings differ (every `prolonged.py` option but those that only say how one call ran:
  `CALL_ONLY`); a setting an older call did not record counts as `prolonged.py`'s default for it;
- one (arm, seed) in two sources;
- a `--warm-start` whose weights are not the one the sources record (`--warm-start-sha256`);
- an `--out` that holds anything but an earlier gather.
`pack` keeps a finished call's record for the repository: its report and plots, `settings.json`, and `runs.tar.gz`
with each run's rows, per-problem counts and end state (no checkpoints, no logs: about 0.6 MB for 6 runs of 1,500
steps). Either a study folder or a packed one can be a source of `gather`.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import sys
import tarfile
from pathlib import Path

import prolonged

# what each run keeps (prolonged.py's run folder): the report reads these and nothing else
RUN_FILES = ("rows.jsonl", "counts.jsonl", "done.json", "stopped.json", "attempts.jsonl", "split.jsonl")
REPORT_FILES = ("call.log", "prolonged.md", "prolonged.json", "settings.json", "pass1.png", "pass64.png", "pass256.png",
                "entropy.png", "kl.png", "length.png")  # fmt: skip
# options that say how one call ran (where, how many at once, until when), not what its runs are
CALL_ONLY = frozenset({"out", "seeds", "arms", "gpus", "per_gpu", "solo_arms", "launch", "mps", "time_limit", "resume",
                       "report_only", "warm_start", "export_warm_start", "step_split", "worker", "seed", "run_dir",
                       "warm_dir", "lock_fd", "mps_env", "warm_start_sha256"})  # fmt: skip
# (the warm start is compared by identity, `warm_start_identity`: a call that trained it recorded no sha256)
RUN_NAME = re.compile(r"[a-z_]+-s(?:0|[1-9]\d*)")  # <arm>-s<seed> as prolonged.py names it: "-s00" is no name
RUN_MEMBER = re.compile(rf"runs/({RUN_NAME.pattern})/({'|'.join(re.escape(name) for name in RUN_FILES)})")
GATHERED = "gathered.json"  # OUT/gathered.json: which runs came from which source


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    pack_parser = commands.add_parser("pack", help="a finished call's record for the repository")
    pack_parser.add_argument("study", help="a prolonged.py --out folder")
    pack_parser.add_argument("dest", help="a new folder: report, plots, settings.json, runs.tar.gz")
    gather_parser = commands.add_parser("gather", help="runs of several calls into one study folder, then its report")
    gather_parser.add_argument("--out", required=True, help="a new folder (or an earlier gather's, rewritten)")
    gather_parser.add_argument("--warm-start", required=True, help="the warm start every source's runs began from")
    gather_parser.add_argument("sources", nargs="+", help="study folders or `pack`ed folders")
    return p.parse_args(argv)


def study_settings(folder: Path) -> dict:
    """The settings that define a source's runs: its settings.json less `CALL_ONLY`, with `prolonged.py`'s default
    for any option its call did not yet have."""
    path = folder / "settings.json"
    if not path.is_file():
        raise SystemExit(f"{folder} has no settings.json: it is not a prolonged.py study folder or a packed one.")
    recorded = json.loads(path.read_text())
    defaults = vars(prolonged.parse_args(["--out", str(folder)]))
    return {key: recorded.get(key, default) for key, default in defaults.items() if key not in CALL_ONLY}


def warm_start_identity(folder: Path) -> str:
    """The sha256 of the (float32) warm start a source's runs began from: its `--warm-start-sha256`, else what its own
    warm_start.json records (the call that trained the warm start; `pack` keeps that file)."""
    recorded = json.loads((folder / "settings.json").read_text()).get("warm_start_sha256")
    if recorded:
        return recorded
    for path in (folder / "warm_start" / "warm_start.json", folder / "warm_start.json"):
        if path.is_file():
            info = json.loads(path.read_text())
            return info.get("made_from_sha256") or info["sha256"]
    raise SystemExit(f"{folder} records no warm start (no --warm-start-sha256, no warm_start.json): nothing ties its "
                     f"runs to one.")  # fmt: skip


def run_files(folder: Path) -> dict[str, dict[str, bytes]]:
    """{run name: {file name: bytes}} of a source, from its runs/ folder or its runs.tar.gz (members outside
    `RUN_MEMBER` are refused, not extracted: an archive names no path of ours)."""
    runs: dict[str, dict[str, bytes]] = {}
    if (folder / "runs").is_dir():
        for run in sorted((folder / "runs").iterdir()):
            if not RUN_NAME.fullmatch(run.name):  # e.g. "no_reset-s00", which the report would read as seed 0 again
                raise SystemExit(f"{run} is not a run folder prolonged.py names (<arm>-s<seed>, the seed without "
                                 f"leading zeros): rename or remove it, then gather again.")  # fmt: skip
            runs[run.name] = {name: (run / name).read_bytes() for name in RUN_FILES if (run / name).is_file()}
        return runs
    archive = folder / "runs.tar.gz"
    if not archive.is_file():
        raise SystemExit(f"{folder} has neither runs/ nor runs.tar.gz: nothing to gather from it.")
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            match = RUN_MEMBER.fullmatch(member.name)
            if not member.isfile() or not match:
                raise SystemExit(f"{archive} holds {member.name!r}, not a run file (runs/<arm>-s<seed>/"
                                 f"{{{','.join(RUN_FILES)}}}): it was not written by `pack`.")  # fmt: skip
            runs.setdefault(match[1], {})[match[2]] = tar.extractfile(member).read()
    return runs


def pack(study: Path, dest: Path) -> dict:
    runs = run_files(study)
    study_settings(study)  # refuses a folder without settings.json
    identity = warm_start_identity(study)
    if not runs:
        raise SystemExit(f"{study} has no runs (runs/<arm>-s<seed>/): nothing to pack.")
    if dest.exists():
        raise SystemExit(f"{dest} exists: pack writes a new folder and replaces nothing. Choose another DEST.")
    dest.mkdir(parents=True)
    for name in REPORT_FILES:
        if (study / name).is_file():
            shutil.copy(study / name, dest / name)
    if (study / "warm_start" / "warm_start.json").is_file():
        shutil.copy(study / "warm_start" / "warm_start.json", dest / "warm_start.json")
    with tarfile.open(dest / "runs.tar.gz", "w:gz") as tar:
        for run, files in sorted(runs.items()):
            for name, data in sorted(files.items()):
                info = tarfile.TarInfo(f"runs/{run}/{name}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    finished = sorted(run for run, files in runs.items() if "done.json" in files)
    return {"dest": str(dest), "runs": sorted(runs), "finished": finished, "warm_start_sha256": identity}


def check_warm_start(warm_start: Path, expected: str, source: Path) -> None:
    """The warm start is the one the runs recorded: its weights' sha256 is theirs, or it is the intact bfloat16 copy
    of theirs (`warm_start.json`'s `made_from_sha256`), as `prolonged.py --warm-start-sha256` accepts it."""
    matches, found = prolonged.warm_start_matches(warm_start, expected)
    if not matches:
        raise SystemExit(f"the warm start in {warm_start} has weights sha256 {found}, and the runs of {source} began "
                         f"from {expected}: pass that warm start.")  # fmt: skip


def gather(out: Path, warm_start: Path, sources: list[Path]) -> dict:
    """Check every source against the first and against the warm start, then write OUT (runs, settings.json,
    warm_start/, gathered.json) and its report. Nothing is written until every check has passed."""
    first, identity = study_settings(sources[0]), warm_start_identity(sources[0])
    origin: dict[str, Path] = {}
    collected: dict[str, dict[str, bytes]] = {}
    for source in sources:
        settings = study_settings(source)
        differing = sorted(key for key in first if settings[key] != first[key])
        if differing:
            what = "; ".join(f"{key}: {first[key]!r} in {sources[0]}, {settings[key]!r} here" for key in differing)
            raise SystemExit(f"{source} ran other settings than {sources[0]} ({what}): its runs are another study. "
                             f"Gather it into its own --out.")  # fmt: skip
        if warm_start_identity(source) != identity:
            raise SystemExit(f"{source} began from warm start {warm_start_identity(source)}, {sources[0]} from "
                             f"{identity}: its runs are another study. Gather it into its own --out.")  # fmt: skip
        for run, files in run_files(source).items():
            if run in origin:
                raise SystemExit(f"{run} is in both {origin[run]} and {source}: pass the source of the run to "
                                 f"report, not both.")  # fmt: skip
            origin[run], collected[run] = source, files
    if not (warm_start / "warm_start.json").is_file():
        raise SystemExit(f"{warm_start} has no warm_start.json: pass the folder prolonged.py made or carried.")
    check_warm_start(warm_start, identity, sources[0])
    if warm_start.resolve().is_relative_to(out.resolve()):
        raise SystemExit(f"--warm-start {warm_start} lies inside --out {out}, which gather rewrites: pass a warm start "
                         f"kept elsewhere.")  # fmt: skip
    earlier = out / GATHERED
    if out.exists() and any(out.iterdir()) and not earlier.is_file():
        raise SystemExit(f"{out} holds files that no gather wrote: choose a new --out.")
    written = json.loads(earlier.read_text())["runs"] if earlier.is_file() else []  # an earlier gather's runs
    if any(not RUN_NAME.fullmatch(run) for run in written):
        raise SystemExit(f"{earlier} lists {written}, not all run folders' names: no gather wrote it. Choose a new "
                         f"--out.")  # fmt: skip
    for run in written:  # remove only what the earlier gather wrote
        shutil.rmtree(out / "runs" / run, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for run, files in sorted(collected.items()):
        (out / "runs" / run).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / "runs" / run / name).write_bytes(data)
    shutil.rmtree(out / "warm_start", ignore_errors=True)
    shutil.copytree(warm_start, out / "warm_start")
    recorded = json.loads((sources[0] / "settings.json").read_text())
    (out / "settings.json").write_text(json.dumps({**recorded, **first, "out": str(out), "warm_start_sha256": identity},
                                                  indent=1))
    gathered = {"runs": sorted(collected), "sources": {run: str(source) for run, source in sorted(origin.items())}}
    earlier.write_text(json.dumps(gathered, indent=1))
    report = prolonged.main(["--out", str(out), "--report-only"])
    return {**gathered, "report": report}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "pack":
        result = pack(Path(args.study), Path(args.dest))
        print(f"packed {len(result['runs'])} runs ({len(result['finished'])} finished) into {result['dest']}")
        return result
    result = gather(Path(args.out), Path(args.warm_start), [Path(source) for source in args.sources])
    print(f"gathered {len(result['runs'])} runs into {args.out}: {args.out}/prolonged.md")
    return result


if __name__ == "__main__":
    main()
