"""Are two GPU runs of one configuration the same run? The first step where runs that should match differ (issue 38).

    python benchmarks/replicates.py m1=runs/r4L1 m2=runs/r4L1-again probe=runs/det --through 375 --out replicates.md
    python benchmarks/replicates.py m1=runs/r4L1 ... --export phase0.csv.gz   # the compared columns, for the record
    python benchmarks/replicates.py --rows phase0.csv.gz --through 375        # the same tables from that file

Each `NAME=DIR` is a `prolonged.py` study folder (`DIR/runs/<arm>-s<seed>/rows.jsonl`). Two kinds of pairs, both the
same run on a bitwise-reproducible stack:
- **across studies**: one (arm, seed) run in two studies (another machine, or the same command again): identical from
  step 1;
- **within a study**: the arms of one seed up to `--through`, the end of their shared first phase (one warm start,
  data order, sampling settings, adapter and optimizer until the first boundary; `prolonged.py`'s phases).
Two rows differ when any of `COMPARED` differs as logged (full float precision; NaN equals NaN). Beside each pair:
whether its validations at step 0 and at `--through` solved each problem the same number of times (`counts.jsonl`),
which separates generation from training: runs with the same weights and reproducible sampling give the same counts.
Why it matters: the study pairs arms by seed; if runs are not reproducible, pairs share their data and warm start but
not their trajectory through phase 0, and two runs of one configuration show how far validation moves from numerics
alone.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import itertools
import json
from collections import defaultdict
from pathlib import Path

from prolonged import read_counts, read_rows

# the per-step training row's columns compared (rows.jsonl keys), and the validation's columns reported
COMPARED = ("loss", "grad_norm", "reward", "completions/mean_length", "entropy", "kl")
VALIDATION = ("eval_pass@1", "eval_pass@64")
COLUMNS = ("study", "run", "step", *COMPARED, *VALIDATION, "correct")  # correct: a validation's per-problem counts


def study_rows(name: str, folder: Path, through: int) -> list[dict]:
    """One study's rows up to step `through`: a training row per (run, step), a validation row per (run, step)."""
    runs = folder / "runs"
    if not runs.is_dir():
        raise SystemExit(f"{folder} has no runs/ folder: give a prolonged.py --out folder as NAME=DIR.")
    table = []
    for run in sorted(path for path in runs.iterdir() if (path / "rows.jsonl").is_file()):
        counts = read_counts(run / "counts.jsonl") if (run / "counts.jsonl").is_file() else {}
        for row in read_rows(run / "rows.jsonl"):
            step = row.get("prorl/global_step")
            if step is None or step > through or not ("loss" in row or "eval_pass@1" in row):
                continue
            kept = {key: row[key] for key in (*COMPARED, *VALIDATION) if key in row}
            table.append({"study": name, "run": run.name, "step": int(step), **kept})
            if "eval_pass@1" in row and step in counts:
                table[-1]["correct"] = counts[step]["correct"]
    return table


def write_csv(rows: list[dict], path: Path) -> None:
    with gzip.open(path, "wt", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        for row in rows:  # repr: a float written back reads as the same float
            writer.writerow({key: json.dumps(value) if key == "correct" else repr(value) if isinstance(value, float)
                             else value for key, value in row.items()})  # fmt: skip


def read_csv(path: Path) -> list[dict]:
    def parse(key: str, value: str):
        if key in ("study", "run"):
            return value
        return int(value) if key == "step" else json.loads(value) if key == "correct" else float(value)

    with gzip.open(path, "rt", newline="") as file:
        return [{key: parse(key, value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]


def training(rows: list[dict]) -> dict[tuple[str, str], dict[int, tuple]]:
    """(study, run) -> step -> the compared values."""
    table = defaultdict(dict)
    for row in rows:
        if "loss" in row:
            values = (row.get(key) for key in COMPARED)
            table[row["study"], row["run"]][row["step"]] = tuple("nan" if value != value else value for value in values)
    return table


def first_difference(a: dict[int, tuple], b: dict[int, tuple]) -> tuple[int, int | None]:
    """(steps compared, the first step whose values differ or None)."""
    common = sorted(set(a) & set(b))
    return len(common), next((step for step in common if a[step] != b[step]), None)


def validations(rows: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(study, run, step) -> that validation's row (pass@k, and `correct` where counts were written)."""
    return {(row["study"], row["run"], row["step"]): row for row in rows if VALIDATION[0] in row}


def validation_at(found: dict, study: str, run: str, step: int) -> str:
    row = found.get((study, run, step))
    return " / ".join(f"{100 * row[key]:.1f}" if key in row else "-" for key in VALIDATION) if row else "-"


def same_counts(found: dict, a: tuple[str, str], b: tuple[str, str], step: int) -> str:
    """Whether runs `a` and `b` ((study, run)) solved each problem the same number of times at `step`: "same",
    "differ", or "-" where either has no counts."""
    counts_a, counts_b = (found.get((*run, step), {}).get("correct") for run in (a, b))
    return "-" if counts_a is None or counts_b is None else "same" if counts_a == counts_b else "differ"


def report(rows: list[dict], through: int) -> str:
    runs, found = training(rows), validations(rows)
    studies = list(dict.fromkeys(row["study"] for row in rows))
    lines = [
        f"## The same (arm, seed) in two studies (steps 1-{through})", "",
        f"| run | studies | steps compared | first differing step | pass@1 / pass@64 at step {through} (%) "
        f"| validation counts at step 0 / {through} |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]  # fmt: skip
    names = sorted({run for _, run in runs})
    for run, (a, b) in itertools.product(names, itertools.combinations(studies, 2)):
        if (a, run) in runs and (b, run) in runs:
            count, step = first_difference(runs[a, run], runs[b, run])
            shown = f"{validation_at(found, a, run, through)} vs {validation_at(found, b, run, through)}"
            same = " / ".join(same_counts(found, (a, run), (b, run), at) for at in (0, through))
            lines.append(f"| {run} | {a} vs {b} | {count} | {step if step else 'none'} | {shown} | {same} |")
    lines += [
        "", f"## Arms of one seed within a study, through their shared first phase (steps 1-{through})", "",
        f"| study | seed | arms | steps compared | first differing step | validation counts at step 0 / {through} |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]  # fmt: skip
    for study in studies:
        by_seed = defaultdict(list)
        for owner, run in runs:
            if owner == study:
                by_seed[run.rsplit("-s", 1)[-1]].append(run)
        for seed, members in sorted(by_seed.items()):
            for a, b in itertools.combinations(sorted(members), 2):
                count, step = first_difference(runs[study, a], runs[study, b])
                same = " / ".join(same_counts(found, (study, a), (study, b), at) for at in (0, through))
                lines.append(f"| {study} | {seed} | {a} vs {b} | {count} | {step if step else 'none'} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="*", help="NAME=DIR: a prolonged.py --out folder, named for the tables")
    p.add_argument("--through", type=int, default=375, help="compare steps 1..N (default 375, round 4's first phase)")
    p.add_argument("--rows", type=Path, help="read the rows from this --export file instead of study folders")
    p.add_argument("--export", type=Path, help="also write the compared rows here (.csv.gz)")
    p.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = p.parse_args(argv)
    if bool(args.rows) == bool(args.studies):
        p.error("give study folders (NAME=DIR ...) or --rows FILE, one of the two")
    if args.rows:
        rows = [row for row in read_csv(args.rows) if row["step"] <= args.through]
    else:
        pairs = [study.partition("=") for study in args.studies]
        if any(not name or not folder for name, _, folder in pairs):
            p.error("each study is NAME=DIR, e.g. machine1=runs/r4L1")
        rows = [row for name, _, folder in pairs for row in study_rows(name, Path(folder), args.through)]
    if args.export:
        write_csv(rows, args.export)
    text = report(rows, args.through)
    if args.out:
        args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
