"""Grading and aggregation on constructed sample files whose correctness is known (no generation involved).

A pre-written `<out>/samples/<model>.jsonl` holding all n samples makes `prorl-trl eval` skip sampling (the resume
path), so the report must equal pass@k computed here by exact combinatorics from the constructed counts.
"""

import json
import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from prorl_trl.evaluation.regression import feature_regression, ols

N = 4
LIMIT = 40


def exact(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def counts_a(i):
    return i % 5  # 0..4 correct of 4 (4 stands for "all", kept as 4)


def counts_b(i):
    return (3 * i + 1) % 5


@pytest.fixture(scope="module")
def math_rows(shared_data):
    from prorl_trl.evaluation.problems import load_rows, with_problem_ids

    return with_problem_ids(load_rows("math500", str(shared_data / "math500"), "test"))[:LIMIT]


def _write_samples(out, name, rows, count):
    path = out / "samples" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    truth = {}
    with open(path, "w") as handle:
        for i, row in enumerate(rows):
            c = min(count(i), N)
            truth[row["problem_id"]] = c
            for s in range(N):
                text = f"So the answer is $\\boxed{{{row['answer']}}}$." if s < c else "I cannot solve this."
                handle.write(json.dumps({"problem_id": row["problem_id"], "sample_index": s, "completion": text}) + "\n")
    return truth


def _eval(args):
    from prorl_trl.cli import main

    return main(["eval", *args])


@pytest.fixture(scope="module")
def constructed(tmp_path_factory, tiny_dir, shared_data, math_rows):
    out = tmp_path_factory.mktemp("constructed")
    truth = {"a": _write_samples(out, "a", math_rows, counts_a), "b": _write_samples(out, "b", math_rows, counts_b)}
    status = _eval([
        "--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--dataset", "math500",
        "--data-files", str(shared_data / "math500"), "--limit", str(LIMIT), "--n", str(N), "--k", "1,2,4",
        "--breakdown", "level,subject", "--out", str(out), "--no-progress", "--num-resamples", "200",
    ])
    assert status == 0
    return out, truth


def test_grades_match_the_constructed_truth(constructed):
    out, truth = constructed
    records = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(records) == 2 * LIMIT * N
    for model in ("a", "b"):
        solved = {}
        for r in records:
            if r["model"] == model:
                solved[r["problem_id"]] = solved.get(r["problem_id"], 0) + r["correct"]
                assert r["reward"] == (1.0 if r["correct"] else 0.0)  # math_equivalence: 1 / 0
        assert solved == truth[model]


def test_summary_equals_exact_pass_at_k_overall_and_per_group(constructed, math_rows):
    out, truth = constructed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["throughput"]["a"]["completions"] == 0  # everything came from the pre-written files
    table = pd.DataFrame(summary["pass_at_k"])
    level = {r["problem_id"]: str(r["level"]) for r in math_rows}
    subject = {r["problem_id"]: r["subject"] for r in math_rows}
    for model in ("a", "b"):
        for k in (1, 2, 4):
            overall = table.query("model == @model and group_by == 'overall' and k == @k").iloc[0]
            assert overall["pass_at_k"] == pytest.approx(np.mean([exact(N, c, k) for c in truth[model].values()]))
            assert overall["ci_low"] <= overall["pass_at_k"] <= overall["ci_high"]
            for field, mapping in (("level", level), ("subject", subject)):
                groups = sorted(set(mapping.values()))
                rows = table.query("model == @model and group_by == @field and k == @k")
                assert sorted(rows["group"]) == groups  # every group is reported
                for group in groups:
                    ids = [p for p, g in mapping.items() if g == group]
                    row = rows[rows["group"] == group].iloc[0]
                    assert row["num_problems"] == len(ids)
                    assert row["pass_at_k"] == pytest.approx(np.mean([exact(N, truth[model][p], k) for p in ids]))
    csv = pd.read_csv(out / "summary.csv")
    assert len(csv) == len(table)


def test_report_and_plots_name_every_model_and_group(constructed, math_rows):
    out, _ = constructed
    report = (out / "report.md").read_text()
    for needle in ("| a |", "| b |", "pass@4", "## pass@k by level", "## pass@k by subject", "Regression"):
        assert needle in report
    for row in math_rows:
        assert f"| {row['subject']} |" in report
    plots = sorted(p.name for p in (out / "plots").iterdir())
    assert plots == sorted(["pass_at_k_overall.png", "pass_at_k_level.png", "pass_at_k_subject.png",
                            "pass_at_1_hist_a.png", "pass_at_1_hist_b.png"])
    assert all((out / "plots" / p).stat().st_size > 5000 for p in plots)


def test_passk_plot_panels_show_both_models_for_every_group(constructed, math_rows):
    """The saved charts are drawn by `passk_figure`: one panel per group, each with a curve and legend entry per model."""
    import matplotlib.pyplot as plt

    from prorl_trl.evaluation.plots import passk_figure

    out, _ = constructed
    table = pd.DataFrame(json.loads((out / "summary.json").read_text())["pass_at_k"])
    for field in ("overall", "level", "subject"):
        fig = passk_figure(table, field)
        panels = [ax for ax in fig.axes if ax.axison]
        groups = {"all"} if field == "overall" else {str(row[field]) for row in math_rows}
        titles = [ax.get_title() for ax in panels]
        assert len(panels) == len(groups)
        if field != "overall":
            assert sorted(title.split(" = ", 1)[1].rsplit(" (", 1)[0] for title in titles) == sorted(groups)
        for ax in panels:
            assert [text.get_text() for text in ax.get_legend().get_texts()] == ["a", "b"]
            assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
            assert all(list(line.get_xdata()) == [1, 2, 4] for line in ax.get_lines())
        plt.close(fig)


def test_always_wrong_subset_counts_what_others_solve(tmp_path, tiny_dir, shared_data, math_rows):
    truth = {"a": _write_samples(tmp_path, "a", math_rows, counts_a), "b": _write_samples(tmp_path, "b", math_rows, counts_b)}
    status = _eval([
        "--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--dataset", "math500",
        "--data-files", str(shared_data / "math500"), "--limit", str(LIMIT), "--n", str(N), "--k", "1,2,4",
        "--subset", "always-wrong:a", "--out", str(tmp_path), "--no-progress", "--no-plots", "--num-resamples", "100",
    ])
    assert status == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    hard = sorted(p for p, c in truth["a"].items() if c == 0)
    assert summary["always_wrong"]["problems"] == hard
    table = {row["k"]: row for row in summary["always_wrong"]["table"]}
    for k in (1, 2, 4):
        assert table[k]["model"] == "b" and table[k]["num_problems"] == len(hard)
        assert table[k]["expected_solved"] == pytest.approx(sum(exact(N, truth["b"][p], k) for p in hard))
        assert table[k]["solved_any"] == sum(truth["b"][p] > 0 for p in hard)
    a_rows = [r for r in summary["pass_at_k"] if r["model"] == "a"]
    assert a_rows and all(r["pass_at_k"] == 0 for r in a_rows)  # restricted to what a never solved
    assert "never solved" in (tmp_path / "report.md").read_text()


def test_always_wrong_subset_labels_the_pass_at_k_chart_and_section(tmp_path, tiny_dir, shared_data, math_rows):
    """With `--subset always-wrong:a` every pass@k is over the problems a never solved: the chart said "all
    problems" and report.md's `## pass@k` said nothing."""
    import matplotlib.pyplot as plt

    from prorl_trl.evaluation.plots import passk_figure, plot_passk

    truth = _write_samples(tmp_path, "a", math_rows, counts_a)
    _write_samples(tmp_path, "b", math_rows, counts_b)
    status = _eval([
        "--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--dataset", "math500",
        "--data-files", str(shared_data / "math500"), "--limit", str(LIMIT), "--n", str(N), "--k", "1,2,4",
        "--subset", "always-wrong:a", "--out", str(tmp_path), "--no-progress", "--num-resamples", "50",
    ])  # fmt: skip
    assert status == 0
    hard = sum(c == 0 for c in truth.values())
    report = (tmp_path / "report.md").read_text()
    section = report.split("## pass@k\n", 1)[1].split("|", 1)[0]
    assert f"Over the {hard} problems `a` never solved (`--subset always-wrong:a`)" in section
    table = pd.DataFrame(json.loads((tmp_path / "summary.json").read_text())["pass_at_k"])
    fig = passk_figure(table, "overall", "problems a never solved")
    assert [ax.get_title() for ax in fig.axes if ax.axison] == [f"problems a never solved ({hard})"]
    plt.close(fig)
    # the chart `eval` saved is that figure, byte for byte
    again = plot_passk(table, tmp_path / "again", "overall", "problems a never solved")
    assert again.read_bytes() == (tmp_path / "plots" / "pass_at_k_overall.png").read_bytes()


@pytest.mark.parametrize(
    ("answer", "integer"),
    [
        ("11,\\! 111,\\! 111,\\! 100", True),  # MATH-500's thin-space thousands separators
        ("\\$32,\\!348", True),
        ("\\$36", True),
        ("10,\\!080", True),
        ("58,500", True),
        ("1,000,000", True),
        ("$-7$", True),
        ("-2,1", False),  # two roots, not a number with a separator
        ("1,-2", False),
        ("3, 5, 7", False),
        ("1,23", False),
        ("1,2345", False),
        ("(2,12) \\cup (12,102)", False),
        ("\\$1.50", False),
    ],
)
def test_integer_answers_after_dollars_thin_spaces_and_thousands_separators(answer, integer):
    from prorl_trl.evaluation.problems import is_integer_answer

    assert is_integer_answer({"answer": answer}) is integer


def test_ols_single_category_gives_group_mean_differences():
    frame = pd.DataFrame({"level": ["1", "1", "2", "2", "2", "3"], "y": [1.0, 0.5, 0.25, 0.0, 0.5, 1.0]})
    table = feature_regression(frame, "y", ["level"]).set_index("term")
    assert table.loc["intercept", "coef"] == pytest.approx(0.75)
    assert table.loc["level=2", "coef"] == pytest.approx(0.25 - 0.75)
    assert table.loc["level=3", "coef"] == pytest.approx(1.0 - 0.75)


def test_ols_matches_scipy_linregress():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, 60).astype(float)
    y = 0.3 + 0.2 * x + rng.normal(0, 0.1, 60)
    table = ols(y, np.column_stack([np.ones(60), x]), ["intercept", "x"]).set_index("term")
    reference = stats.linregress(x, y)
    assert table.loc["x", "coef"] == pytest.approx(reference.slope)
    assert table.loc["x", "std_err"] == pytest.approx(reference.stderr)
    assert table.loc["x", "p"] == pytest.approx(reference.pvalue, rel=1e-6)
    assert table.loc["intercept", "std_err"] == pytest.approx(reference.intercept_stderr)
    with pytest.raises(ValueError, match="more problems"):
        ols(np.array([0.1, 0.2]), np.array([[1.0, 0.0], [1.0, 1.0]]), ["intercept", "x"])


def test_always_wrong_reference_that_solved_everything_gives_an_empty_subset(tmp_path, tiny_dir, shared_data, math_rows):
    _write_samples(tmp_path, "a", math_rows, lambda i: N)
    _write_samples(tmp_path, "b", math_rows, counts_b)
    status = _eval([
        "--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--dataset", "math500",
        "--data-files", str(shared_data / "math500"), "--limit", "5", "--n", str(N), "--k", "1,4",
        "--subset", "always-wrong:a", "--out", str(tmp_path), "--no-progress", "--no-plots",
    ])
    assert status == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["always_wrong"]["problems"] == [] and summary["pass_at_k"] == []
    assert "(0 problems)" in (tmp_path / "report.md").read_text()


def test_non_integer_subset_keeps_only_non_integer_gold_answers(math_rows):
    from prorl_trl.evaluation.problems import is_integer_answer, select

    assert [is_integer_answer({"answer": a}) for a in ["12", "-3", "$5$", "1,000", "\\frac{1}{2}", "2\\sqrt{3}", "0.5"]] == [
        True, True, True, True, False, False, False
    ]
    kept = select(math_rows, "non-integer", limit=5)
    assert len(kept) == 5 and not any(is_integer_answer(r) for r in kept)
    assert [r["problem_id"] for r in kept] == [r["problem_id"] for r in math_rows if not is_integer_answer(r)][:5]
