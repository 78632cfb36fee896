"""CPU throughput of every registry reward, side by side with its `trl.rewards` equivalent, on GSM8K-style completions.

Completions are built from the GSM8K test golds (`../shared/data/gsm8k/test.jsonl`), one of each kind per gold:
correct answers in several spellings (`\\boxed{1,234}`, `\\boxed{\\$1234.00}`, `\\boxed{1234 \\text{ dollars}}`,
`\\boxed{x = 1234}`), wrong answers (off by one, doubled), an unboxed final sentence, and noisy ones (the worked
solution with its `<<a=b>>` annotations, an earlier wrong box, think/answer tags). Each completion's ground truth is
known by construction: correct iff its last box holds the gold number. `kk_logic` gets knights-and-knaves completions
built the same way from `kk/*ppl_test.jsonl`. Token ids are the UTF-8 bytes (the tiny tokenizer's ids).

Every reward is called as GRPOTrainer calls it (keyword arguments, batches of `--batch-size` completions, dataset
columns repeated per completion) in this one process, so a single core does the work; `math_equivalence` uses its
math-verify worker only for answers its fast path cannot decide (none in GSM8K; counted in the table). TRL's rewards
get the gold in the form they parse best (the GSM8K number itself, as `accuracy_reward` cannot read `#### 1,234`;
MATH answers inside `$...$`) and conversational completions (the only format they accept). A last row scores
MATH-500 answers (gold, an equivalent rewrite such as `\\frac12` or `2\\,220`, a wrong one), where most comparisons
need the symbolic path. Reported: completions/s over the whole run (best of `--repeats`), median milliseconds per
completion over batches, and agreement with the ground truth for correctness rewards.

Two more tables follow. Worst cases: seconds per completion of `math_equivalence` on the inputs that broke its time
bound (`(x+1)^{9999}`, `2^{999!}`, a 129-term polynomial) and on the item right after a timeout, from the main thread
and a worker thread. The MATH-500 differential: every gold against itself, its neighbour and 20+ perturbations,
`math_equivalence` and math-verify side by side (tests/test_rewards_differential.py runs a seeded part of it).

    python benchmarks/rewards_throughput.py            # full run (>= 5,000 completions), writes the results file
    python benchmarks/rewards_throughput.py --smoke    # a few hundred completions, one worst case, 10 golds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, cpu_name, publish, utc_now, versions  # first: the repository on sys.path

import rewards  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data"
RESULTS_FILE = ROOT / "benchmarks" / "results" / "rewards_throughput.md"


def gsm8k_completions(data_dir: Path, count: int, seed: int = 0) -> tuple[list[str], list[str], list[bool]]:
    """`count` completions, their raw GSM8K gold answers, and whether each is correct by construction."""
    rows = [json.loads(line) for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    texts, golds, truth = [], [], []
    while len(texts) < count:
        for row in rows:
            final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            value = int(final) if final.lstrip("-").isdigit() else float(final)
            work = row["answer"].rsplit("####", 1)[0].strip()
            with_commas = f"{value:,}" if isinstance(value, int) else final
            wrong = value + rng.choice([1, -1, 10])
            variants = [
                (rf"Let me compute. {work} The answer is $\boxed{{{final}}}$.", True),
                (rf"{work}\nSo the total is \boxed{{{with_commas}}}", True),
                (rf"<think>\n{work}\n</think>\n<answer>\n\boxed{{\${final}.00}}\n</answer>", True),
                (rf"{work} Hence \boxed{{{final} \text{{ dollars}}}}.", True),
                (rf"First, set up. Next, {work} Finally, \boxed{{x = {final}}}", True),
                (rf"I first guessed \boxed{{{wrong}}} but rechecking: {work} so \boxed{{{final}}}", True),
                (rf"{work} The answer is \boxed{{{wrong}}}.", False),
                (rf"Step 1: {work}\nStep 2: double it: \boxed{{{value * 2 + 1}}}", False),
                (rf"{work} so she has {final} left.", False),
                (rf"\boxed{{{final}}} was my first guess; {work} actually \boxed{{{wrong}}}", False),
            ]
            text, correct = variants[len(texts) % len(variants)]
            texts.append(text)
            golds.append(row["answer"])
            truth.append(correct)
            if len(texts) == count:
                break
    return texts, golds, truth


def kk_completions(data_dir: Path, count: int) -> tuple[list[str], list[list[str]], list[list[bool]]]:
    rows = []
    for path in sorted((data_dir / "kk").glob("*ppl_test.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    texts, names, solutions = [], [], []
    while len(texts) < count:
        for row in rows:
            roles = list(row["solution"])
            if len(texts) % 3 == 1:
                roles[0] = not roles[0]
            body = "\n".join(
                f"({i + 1}) {n} is a {'knight' if r else 'knave'}" for i, (n, r) in enumerate(zip(row["names"], roles))
            )
            think = f"<think>{row['quiz'][:300]} Let me check each statement.</think>"
            text = f"{think}<answer>{body}</answer>" if len(texts) % 3 != 2 else f"{body}"
            texts.append(text)
            names.append(row["names"])
            solutions.append(row["solution"])
            if len(texts) == count:
                break
    return texts, names, solutions


def math500_completions(data_dir: Path, count: int) -> tuple[list[str], list[str], list[bool]]:
    """Per MATH-500 answer: the gold boxed, an equivalent rewrite (`\\frac12`, `\\sqrt2`, `1\\,000`, no degree sign,
    spaces), and a wrong one (last digit changed, or another problem's answer); ground truth by construction."""
    rows = [json.loads(line) for line in (data_dir / "math500" / "test.jsonl").read_text().splitlines()][:count]
    rewrites = [
        (re.compile(r"\\[dt]?frac\{(\d)\}\{(\d)\}"), r"\\frac\1\2"),
        (re.compile(r"\\sqrt\{(\d)\}"), r"\\sqrt\1"),
        (re.compile(r"^(\d{1,3})(\d{3})$"), r"\1\\,\2"),
        (re.compile(r"\^\\circ"), ""),
        (re.compile(r"(?<!\\),(?=\S)"), ", "),
    ]
    texts, golds, truth = [], [], []
    for index, row in enumerate(rows):
        gold = row["answer"]
        rewritten = gold
        for pattern, replacement in rewrites:
            rewritten = pattern.sub(replacement, rewritten)
        digits = [i for i, c in enumerate(gold) if c.isdigit()]
        if digits:
            last = digits[-1]
            wrong = gold[:last] + str((int(gold[last]) + 1) % 10) + gold[last + 1 :]
        else:
            wrong = rows[(index + 1) % len(rows)]["answer"]
        for text, correct in ((gold, True), (rewritten, True), (wrong, False)):
            texts.append(rf"Reasoning... so the final answer is $\boxed{{{text}}}$.")
            golds.append(gold)
            truth.append(correct)
    return texts, golds, truth


def measure(function, batches: list[dict], repeats: int) -> tuple[float, float, list]:
    """(completions/s of the best run, median ms per completion over batches, outputs of the last run)."""
    best_total, per_completion_ms, outputs = float("inf"), [], []
    for _ in range(repeats):
        for cache in (rewards.gold_text, rewards.gold_number, rewards.correctness._read_gold):
            cache.cache_clear()
        outputs, times = [], []
        for batch in batches:
            start = time.perf_counter()
            outputs += function(**batch)
            times.append((time.perf_counter() - start) / len(batch["completion_ids"]))
        total = sum(time * len(batch["completion_ids"]) for time, batch in zip(times, batches))
        if total < best_total:
            best_total, per_completion_ms = total, [1000 * t for t in times]
    count = sum(len(batch["completion_ids"]) for batch in batches)
    return count / best_total, statistics.median(per_completion_ms), outputs


def agreement(outputs: list, truth: list[bool], correct_value: float) -> float:
    return sum((value == correct_value) == label for value, label in zip(outputs, truth)) / len(truth)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data folder (default ../shared/data)")
    parser.add_argument("--num-completions", type=int, default=6000, help="GSM8K-style completions (>= 5000)")
    parser.add_argument("--batch-size", type=int, default=64, help="completions per reward call")
    parser.add_argument("--repeats", type=int, default=3, help="runs per reward; the best is reported")
    parser.add_argument(
        "--output", type=Path, default=None, help=f"markdown file (default {RESULTS_FILE} unless --smoke)"
    )
    parser.add_argument("--smoke", action="store_true", help="a few hundred completions, one repeat, no results file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_completions, args.repeats = min(args.num_completions, 200), 1
    elif args.output is None:
        args.output = RESULTS_FILE

    from trl.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
    )

    texts, golds, truth = gsm8k_completions(args.data, args.num_completions)
    numbers = [gold.rsplit("####", 1)[1].strip().replace(",", "") for gold in golds]
    ids = [list(text.encode()) for text in texts]
    max_len = 1024

    def batches_of(**columns) -> list[dict]:
        return [
            {key: values[start : start + args.batch_size] for key, values in columns.items()}
            for start in range(0, len(texts), args.batch_size)
        ]

    ours = batches_of(
        prompts=[f"p{i // 8}" for i in range(len(texts))], completions=texts, completion_ids=ids, answer=golds
    )
    theirs = batches_of(
        completions=[[{"role": "assistant", "content": t}] for t in texts], completion_ids=ids, solution=numbers
    )
    kk_texts, kk_names, kk_solutions = kk_completions(args.data, len(texts))
    kk_batches = [
        {
            "completions": kk_texts[s : s + args.batch_size],
            "completion_ids": [[0]] * len(kk_texts[s : s + args.batch_size]),
            "names": kk_names[s : s + args.batch_size],
            "solution": kk_solutions[s : s + args.batch_size],
        }
        for s in range(0, len(kk_texts), args.batch_size)
    ]
    overlong = dict(max_completion_len=max_len, soft_punish_cache=256)
    cosine = get_cosine_scaled_reward(max_len=max_len)
    trl_equivalents = {
        "boxed_answer": ("accuracy_reward", lambda **b: accuracy_reward(**b)),
        "math_equivalence": ("accuracy_reward", lambda **b: accuracy_reward(**b)),
        "cosine_scaled": ("get_cosine_scaled_reward", lambda **b: cosine(**b)),
        "repetition_penalty": ("get_repetition_penalty_reward", get_repetition_penalty_reward()),
        "soft_overlong": ("get_soft_overlong_punishment", get_soft_overlong_punishment(**overlong)),
    }
    params = {"cosine_scaled": {"max_len": max_len}, "soft_overlong": overlong}

    from rewards._verify import shared_pool

    rows, trl_cache = [], {}
    for name in sorted(rewards.BUILTIN_REWARDS):
        reward = rewards.get_reward(name, **params.get(name, {}))
        batches = kk_batches if name == "kk_logic" else ours
        worker_items = _worker_items(reward, batches) if name == "math_equivalence" else None
        rate, median_ms, outputs = measure(reward, batches, args.repeats)
        row = {
            "reward": name,
            "rate": rate,
            "median_ms": median_ms,
            "trl": "—",
            "trl_rate": None,
            "trl_ms": None,
            "agree": None,
            "trl_agree": None,
            "worker_items": worker_items,
        }
        if name in ("boxed_answer", "math_equivalence"):
            row["agree"] = agreement(outputs, truth, reward.correct)
        if name in trl_equivalents:
            trl_name, trl_function = trl_equivalents[name]
            if trl_name not in trl_cache:  # accuracy_reward is slow: measure it once for both correctness rewards
                trl_cache[trl_name] = measure(
                    trl_function, theirs, 1 if trl_name == "accuracy_reward" else args.repeats
                )
            trl_rate, trl_ms, trl_outputs = trl_cache[trl_name]
            row.update(trl=trl_name, trl_rate=trl_rate, trl_ms=trl_ms)
            if trl_name == "accuracy_reward":
                row["trl_agree"] = agreement(trl_outputs, truth, 1.0)
        rows.append(row)
        print(f"{name}: {rate:,.0f} completions/s", file=sys.stderr)
    # MATH-style answers: most need the symbolic path (math-verify in the worker process), so this is its speed.
    math_texts, math_golds, math_truth = math500_completions(args.data, 50 if args.smoke else 500)
    math_ours = [
        {
            "completions": math_texts[s : s + args.batch_size],
            "completion_ids": [[0]] * len(math_texts[s : s + args.batch_size]),
            "answer": math_golds[s : s + args.batch_size],
        }
        for s in range(0, len(math_texts), args.batch_size)
    ]
    math_theirs = [
        {
            "completions": [[{"role": "assistant", "content": t}] for t in batch["completions"]],
            "completion_ids": batch["completion_ids"],
            "solution": [f"${gold}$" for gold in batch["answer"]],
        }
        for batch in math_ours
    ]
    reward = rewards.get_reward("math_equivalence")
    reward(completions=[r"\boxed{x+1}"], answer=["1+x"])  # start the worker process: a one-time cost, not throughput
    worker_items = _worker_items(reward, math_ours)
    rate, median_ms, outputs = measure(reward, math_ours, args.repeats)
    trl_rate, trl_ms, trl_outputs = measure(lambda **b: accuracy_reward(**b), math_theirs, 1)
    rows.append(
        {
            "reward": f"math_equivalence on {len(math_texts)} MATH-500 answers",
            "rate": rate,
            "median_ms": median_ms,
            "trl": "accuracy_reward",
            "trl_rate": trl_rate,
            "trl_ms": trl_ms,
            "agree": agreement(outputs, math_truth, 1.0),
            "trl_agree": agreement(trl_outputs, math_truth, 1.0),
            "worker_items": worker_items,
        }
    )
    worst = worst_cases(args.smoke)
    differential = run_differential(args)
    shared_pool().close()
    table = "\n\n".join([render(rows, args, len(texts)), render_worst_cases(worst), differential])
    publish(table, args.output)
    return table


def _worker_items(reward, batches: list[dict]) -> int:
    """How many completions `math_equivalence` cannot decide without math-verify."""
    return sum(
        isinstance(reward._fast_check(rewards.completion_text(c), g), tuple)
        for batch in batches
        for c, g in zip(batch["completions"], batch["answer"])
    )


def _cpu_context() -> str:
    """How many cores this process may use and how busy the machine was: shared machines give noisy rates."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"single-threaded Python; cores allowed to this process: {cores}; load average (1/5/15 min): {load}"


# ----------------------------------------------------------------------------------------------- worst cases


def _polynomial_pair(terms: int, rng: random.Random) -> tuple[str, str]:
    """A `terms`-term polynomial and the same terms in another order (a correct answer)."""
    monomials = [f"{rng.randint(1, 99)}x^{{{power}}}" for power in range(terms)]
    shuffled = monomials[:]
    rng.shuffle(shuffled)
    return " + ".join(monomials), " + ".join(shuffled)


def worst_case_scenarios() -> list[tuple[str, list[tuple[str, str]]]]:
    """(label, [(answer, gold), ...]): the issue's worst cases, each item graded by its own call in order; the last
    item is the one the label names."""
    rng = random.Random(0)
    gold_60, answer_60 = _polynomial_pair(60, rng)
    gold_129, answer_129 = _polynomial_pair(129, rng)
    fibonacci_gold = " + ".join(f"F_{{{k}}}F_{{{21 - k}}}" for k in range(1, 21))
    fibonacci_answer = " + ".join(f"F_{{{21 - k}}}F_{{{k}}}" for k in range(1, 21))
    expand, factorial = (r"(x+1)^{9999}", "1"), (r"2^{999!}", "2")
    symbolic = ("x+1", r"\frac{x^2-1}{x-1}")  # no fast path decides it: a worker must
    return [
        (r"`(x+1)^{9999}` vs 1 (times out)", [expand]),
        (r"`2^{999!}` vs 2 (times out)", [factorial]),
        ("correct 129-term polynomial, terms shuffled", [(answer_129, gold_129)]),
        ("correct 60-term polynomial, right after a timeout", [factorial, (answer_60, gold_60)]),
        ("correct 129-term polynomial, right after a timeout", [expand, (answer_129, gold_129)]),
        (
            "Fibonacci convolution with factors swapped, right after a timeout",
            [factorial, (fibonacci_answer, fibonacci_gold)],
        ),
        (r"symbolic `x+1` vs `\frac{x^2-1}{x-1}` (math-verify), right after a timeout", [expand, symbolic]),
        ("the same symbolic item, right after 2 timeouts in a row", [expand, factorial, symbolic]),
        ("the same, right after 3 timeouts in a row (more than the 2 spares)", [expand, factorial, expand, symbolic]),
    ]


def worst_cases(smoke: bool, repeats: int = 2) -> list[dict]:
    """Seconds per completion of each worst case with the default 1 s limit, from the main thread and from a worker
    thread (TRL's async path), the workers warm before each scenario as between training steps."""
    import threading

    from rewards._verify import shared_pool

    reward = rewards.get_reward("math_equivalence")
    pool = shared_pool()
    scenarios = worst_case_scenarios()
    if smoke:
        scenarios, repeats = [scenarios[6]], 1
    rows = []
    for thread in ("main thread", "worker thread") if not smoke else ("main thread",):
        for label, items in scenarios:
            seconds, verdicts = [], []
            for _ in range(repeats):
                pool.wait_until_warm()

                def grade_all():
                    for answer, gold in items:
                        start = time.perf_counter()
                        verdicts.append(reward(completions=[rf"\boxed{{{answer}}}"], answer=[gold])[0])
                        seconds.append(time.perf_counter() - start)

                if thread == "main thread":
                    grade_all()
                else:
                    worker = threading.Thread(target=grade_all)
                    worker.start()
                    worker.join()
            last = verdicts[len(items) - 1 :: len(items)]
            named = max(seconds[len(items) - 1 :: len(items)])
            rows.append({"case": label, "thread": thread, "max_s": max(seconds), "named_s": named, "last": last})
    return rows


def render_worst_cases(rows: list[dict]) -> str:
    lines = [
        "## Worst cases: seconds per completion (math_equivalence, default `timeout_seconds=1.0`)",
        "",
        "Each scenario's completions are graded one call each, in order, after the 3 workers are warm; `max s` is the "
        "slowest completion of the scenario over its repeats (bound: 1.2 s), `named item s` the slowest time of the "
        "item the row names (the last one); `verdict` is that item's reward per repeat (None = timed out, skipped and "
        "counted in `rewards/math_equivalence/timeouts`).",
        "",
        "| case | thread | max s per completion | named item s | verdict of the named item | within 1.2 s |",
        "|---|---|---:|---:|---|---|",
    ]
    for row in rows:
        verdict = ", ".join("None" if value is None else f"{value:.0f}" for value in row["last"])
        within = "yes" if row["max_s"] <= 1.2 else "**no**"
        lines.append(
            f"| {row['case']} | {row['thread']} | {row['max_s']:.3f} | {row['named_s']:.3f} | {verdict} | {within} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- differential


def run_differential(args) -> str:
    """The MATH-500 differential on every gold (10 in --smoke): math_equivalence vs math-verify as TRL runs it."""
    import _math_perturbations as perturbations

    golds = perturbations.load_golds(args.data)
    indices = list(range(10 if args.smoke else len(golds)))
    reward = rewards.get_reward("math_equivalence", timeout_seconds=20.0)
    start = time.perf_counter()
    records = perturbations.run(golds, indices, reward, None)
    ours_seconds = time.perf_counter() - start
    math_verify = perturbations.MathVerify()
    start = time.perf_counter()
    for record in records:
        record["math_verify"] = math_verify(record["gold"], record["answer"])
    theirs_seconds = time.perf_counter() - start
    lines = [
        f"## MATH-500 differential: {len(indices)} golds, {len(records)} comparisons",
        "",
        "Each gold against itself, the next problem's gold and 20+ perturbations whose verdict is known by "
        "construction "
        "(benchmarks/_math_perturbations.py); math-verify configured as `trl.rewards.accuracy_reward` runs it. "
        f"Time on this core: math_equivalence {ours_seconds:.1f} s, math-verify {theirs_seconds:.1f} s "
        "(symbolic limit raised to 20 s here: verdicts, not the time bound, are measured).",
        "",
        *perturbations.summary_table(records),
    ]
    return "\n".join(lines)



def render(rows: list[dict], args, count: int) -> str:
    def rate(value):
        return "—" if value is None else f"{value:,.0f}"

    def ms(value):
        return "—" if value is None else f"{value:.4f}"

    def pct(value):
        return "—" if value is None else f"{100 * value:.1f}%"

    lines = [
        f"# Reward throughput (CPU, one core){' — smoke run' if args.smoke else ''}",
        "",
        f"- date: {utc_now()}",
        f"- CPU: {cpu_name()} (lscpu model name); Python {platform.python_version()}; {versions('trl')}",
        f"- {_cpu_context()}",
        f"- {count} GSM8K-style completions from gsm8k/test.jsonl golds (kk_logic: {count} from kk/*ppl_test.jsonl), "
        f"batches of {args.batch_size}, best of {args.repeats} runs (accuracy_reward: 1 run)",
        "- agreement = fraction of completions where reward says correct iff the constructed ground truth says so",
        "",
        "| reward | completions/s | median ms/completion | agreement | trl.rewards equivalent | trl completions/s "
        "| trl median ms | trl agreement | speed-up |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        speedup = "—" if row["trl_rate"] is None else f"{row['rate'] / row['trl_rate']:.1f}×"
        name = row["reward"] + (f" ({row['worker_items']} via math-verify)" if row["worker_items"] is not None else "")
        lines.append(
            f"| {name} | {rate(row['rate'])} | {ms(row['median_ms'])} | {pct(row['agree'])} | {row['trl']} "
            f"| {rate(row['trl_rate'])} | {ms(row['trl_ms'])} | {pct(row['trl_agree'])} | {speedup} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
