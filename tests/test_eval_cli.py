"""`python -m prorl_trl eval` end to end on two tiny saved models over MATH-500 rows: real sampling, grading with
the registry, breakdowns, the always-wrong subset, every output file, resume, and argument errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from prorl_trl.cli import main as cli_main
from prorl_trl.tiny import save_tiny

REPO = Path(__file__).resolve().parent.parent
LIMIT, N = 6, 4


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "seed0", seed=0), save_tiny(root / "seed1", seed=1)


def _args(two_models, shared_data, out, *extra):
    first, second = two_models
    return [
        "eval", "--model", f"first={first}", "--model", f"second={second}", "--dataset", "math500",
        "--data-files", str(shared_data / "math500"), "--limit", str(LIMIT), "--n", str(N), "--k", "1,2,4",
        "--max-new-tokens", "8", "--breakdown", "level,subject", "--out", str(out), "--no-progress",
        "--num-resamples", "100", "--device", "cpu", "--num-threads", "1", *extra,
    ]


@pytest.fixture(scope="module")
def run(two_models, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "prorl_trl", *_args(two_models, shared_data, out, "--subset", "always-wrong:first")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def test_all_files_are_written_with_both_models_and_every_group(run, shared_data):
    out, stdout = run
    for name in ("samples.jsonl", "summary.json", "summary.csv", "report.md", "per_problem.csv",
                 "samples/first.jsonl", "samples/second.jsonl"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    hard = summary["always_wrong"]["problems"]
    assert summary["settings"]["always_wrong"] == "first" and len(hard) >= 1
    rows = [json.loads(line) for line in open(shared_data / "math500" / "test.jsonl")][:LIMIT]
    hard_rows = [r for r in rows if r["unique_id"] in hard]
    table = pd.DataFrame(summary["pass_at_k"])
    assert set(table["model"]) == {"first", "second"}
    for field in ("level", "subject"):
        groups = {str(r[field]) for r in hard_rows}
        for model in ("first", "second"):
            assert set(table.query("model == @model and group_by == @field")["group"]) == groups
    report = (out / "report.md").read_text()
    assert "| first |" in report and "| second |" in report and "never solved" in report
    for r in hard_rows:
        assert f"| {r['subject']} |" in report
    plots = {p.name for p in (out / "plots").iterdir()}
    assert plots == {"pass_at_k_overall.png", "pass_at_k_level.png", "pass_at_k_subject.png",
                     "pass_at_1_hist_first.png", "pass_at_1_hist_second.png"}
    assert [line for line in stdout.splitlines() if "completions/s" in line]


def test_samples_are_graded_and_the_second_model_only_sampled_the_subset(run):
    out, _ = run
    records = [json.loads(line) for line in open(out / "samples.jsonl")]
    summary = json.loads((out / "summary.json").read_text())
    first = [r for r in records if r["model"] == "first"]
    second = [r for r in records if r["model"] == "second"]
    assert len(first) == LIMIT * N
    assert {r["problem_id"] for r in second} == set(summary["always_wrong"]["problems"])
    for r in records:
        assert r["reward"] in (0.0, 1.0) and isinstance(r["correct"], bool) and 1 <= r["num_tokens"] <= 8
    throughput = summary["throughput"]
    assert throughput["first"]["completions"] == LIMIT * N and throughput["first"]["completions_per_s"] > 0


def test_rerun_resumes_without_sampling_and_more_samples_only_draw_the_new_ones(run, two_models, shared_data):
    out, _ = run
    before = (out / "samples" / "first.jsonl").read_text()
    drawn = json.loads((out / "summary.json").read_text())["throughput"]["first"]
    assert cli_main(_args(two_models, shared_data, out, "--subset", "always-wrong:first", "--no-plots")) == 0
    assert (out / "samples" / "first.jsonl").read_text() == before
    # every sample read back: the report keeps the rate they were drawn at, marked as an earlier run's (issue 39)
    assert json.loads((out / "summary.json").read_text())["throughput"]["first"] == {**drawn, "earlier_run": True}
    assert "| first | transformers (an earlier run into this folder) | 24 |" in (out / "report.md").read_text()

    more = _args(two_models, shared_data, out, "--no-plots")
    more[more.index("--n") + 1] = "5"
    assert cli_main(more) == 0
    after = (out / "samples" / "first.jsonl").read_text()
    assert after.startswith(before) and len(after.splitlines()) == LIMIT * (N + 1)
    assert json.loads((out / "summary.json").read_text())["throughput"]["first"]["completions"] == LIMIT

    changed = _args(two_models, shared_data, out, "--no-plots")
    changed[changed.index("--max-new-tokens") + 1] = "9"
    assert cli_main(changed) == 2  # other sampling settings than the stored samples: refused up front


def test_the_demos_generated_task_evaluates_and_the_report_path_is_printed(two_models, tmp_path, capsys):
    """Issue 39: `eval` could not evaluate the demo's own synthetic task, and never said where its report went."""
    first, _ = two_models
    out = tmp_path / "synthetic"
    status = cli_main([
        "eval", "--model", f"first={first}", "--dataset", "synthetic_arithmetic", "--split", "validation",
        "--data-option", "num_validation=5", "--data-option", "num_steps=1", "--prompt-format", "plain", "--n", "2",
        "--k", "1,2", "--max-new-tokens", "6", "--out", str(out), "--no-progress", "--no-plots", "--device", "cpu",
        "--num-resamples", "50",
    ])  # fmt: skip
    assert status == 0
    assert f"prorl-trl eval: report {out / 'report.md'}" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["reward"] == "boxed_answer" and summary["settings"]["num_problems"] == 5


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--k", "1,8"], "--n"), (["--subset", "always-wrong:nobody"], "nobody"), (["--reward", "nope"], "Unknown reward"),
     (["--breakdown", "colour"], "colour"), (["--subset", "odd"], "non-integer"),
     (["--model", "third=/no/such/model"], "third=/no/such/model: local model folder not found"),
     (["--model", "third=runs/no-run/final"], "third=runs/no-run/final: local model folder not found"),
     (["--device", "cuda:0"], "CUDA is not available")],
)
def test_bad_arguments_exit_2_before_any_work(two_models, shared_data, tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    assert cli_main(_args(two_models, shared_data, out, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_out_folder_of_other_files_is_refused_and_left_as_it_was(two_models, shared_data, tmp_path, capsys):
    """The report, summaries and plots were written over a user's files of those names in any --out."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.md").write_text("my report")
    (out / "summary.json").write_text("{}")
    assert cli_main(_args(two_models, shared_data, out)) == 2
    assert "holds no evaluation" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "summary.json"]
    assert (out / "report.md").read_text() == "my report"


def _texts(path):
    samples = {}
    for line in open(path):
        record = json.loads(line)
        samples.setdefault(record["problem_id"], {})[record["sample_index"]] = record["completion"]
    return {pid: [texts[s] for s in sorted(texts)] for pid, texts in samples.items()}


def test_a_larger_n_into_the_same_out_draws_new_samples_not_copies_and_a_new_seed_is_refused(
    two_models, shared_data, tmp_path, capsys
):
    """The missing samples of a rerun with a larger --n fill batches laid out like the first run's; seeding a batch
    by its position drew samples 2-3 as byte copies of samples 0-1. Seeded by its jobs, they are new draws."""
    first, _ = two_models
    out = tmp_path / "out"
    args = [
        "eval", "--model", f"first={first}", "--dataset", "math500", "--data-files", str(shared_data / "math500"),
        "--limit", "3", "--k", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--no-plots",
        "--num-resamples", "10", "--device", "cpu", "--num-threads", "1",
    ]  # fmt: skip
    assert cli_main([*args, "--n", "2"]) == 0
    assert cli_main([*args, "--n", "4"]) == 0
    texts = _texts(out / "samples" / "first.jsonl")
    assert len(texts) == 3 and all(len(samples) == 4 for samples in texts.values())
    for pid, samples in texts.items():
        assert samples[2:] != samples[:2], pid
    # Stored samples drawn with seed 0 are not passed off as seed 1's: refused like another temperature.
    capsys.readouterr()
    assert cli_main([*args, "--n", "4", "--seed", "1"]) == 2
    assert "sampled with other settings (seed: 0 -> 1)" in capsys.readouterr().err


def test_distills_teacher_sampler_refuses_samples_of_another_seed_before_any_sampling(tiny_dir, tmp_path):
    """Distillation resamples when its seed changes (`_sampling_key`); the teacher's stored samples of the old seed
    are refused up front (as for another temperature), not reused under the new seed's name."""
    from prorl_trl.distill import DistillConfig, distill
    from prorl_trl.distill.rejection_sampling import teacher_sample_fn

    out = tmp_path / "distill"
    sample = teacher_sample_fn(str(tiny_dir), out, max_completion_length=4, seed=0, device="cpu", name="teacher-part0")
    assert len(sample(["1+1="], 2)[0]) == 2
    before = (out / "samples" / "teacher-part0.jsonl").read_text()
    config = DistillConfig(
        teacher=str(tiny_dir), student=str(tiny_dir), dataset="jsonl", reward="boxed_answer", output_dir=str(out),
        samples=2, max_completion_length=4, seed=1, use_cpu=True, bf16=False, report_to="none",
    )
    def always_right(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match=r"teacher-part0\.jsonl was sampled with other settings \(seed: 0 -> 1\)"):
        distill(config, problems=[{"prompt": "1+1=", "answer": "2"}], reward_fn=always_right)
    assert (out / "samples" / "teacher-part0.jsonl").read_text() == before


def test_a_killed_runs_partial_last_line_is_dropped_and_a_complete_one_kept(tiny_dir, tmp_path):
    """A run killed mid-write leaves a last line without newline: appending onto it glued the next record to it,
    and both were lost (`read_samples` skips the unparsable line), so the file missed a sample for good."""
    from prorl_trl.evaluation.runner import ModelSpec, read_samples, sample_model, samples_file
    from prorl_trl.evaluation.sampling import SamplingSettings

    spec = ModelSpec("tiny", str(tiny_dir))
    problems = [{"problem_id": str(i), "prompt": f"{i}+{i}="} for i in range(2)]

    def run(num_samples):
        settings = SamplingSettings(num_samples=num_samples, max_completion_length=4, batch_size=8)
        return sample_model(spec, problems, settings, tmp_path, device="cpu", progress=False)

    run(1)
    path = samples_file(tmp_path, "tiny")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed halfway through the second record
    records, stats = run(2)
    assert stats["completions"] == 3 and len(records) == 4
    stored = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses: nothing glued
    assert len(stored) == 4 and set(read_samples(path)) == {(p["problem_id"], s) for p in problems for s in (0, 1)}

    path.write_text(path.read_text().rstrip("\n"))  # a complete last record, killed before its newline
    records, stats = run(3)
    assert stats["completions"] == 2
    assert path.read_text().startswith("".join(line + "\n" for line in map(json.dumps, stored)))
    assert len(read_samples(path)) == 6 and all(json.loads(line) for line in path.read_text().splitlines())
