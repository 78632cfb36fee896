"""`benchmarks/generation.py --smoke`: every method runs on the tiny model on CPU and the report is well formed."""

import json
import os

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("generation")


def test_smoke_run_measures_every_method_and_renders_the_table(bench, tmp_path, capsys):
    result = bench.main(["--smoke", "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md")])
    rows = result["rows"]
    expected = {(model, method) for model in ("base", "lora") for method in
                ("trl_default", "static_compile", "static_compile_gqa", "static_compile_top_p1", "rollout_engine",
                 "rollout_engine_unfused", "rollout_engine_separate", "rollout_engine_autotune",
                 "rollout_engine_unfused_mlp", "rollout_engine_fixed_splits", "rollout_engine_unfolded",
                 "rollout_engine_torch_race", "rollout_engine_torch_softmax", "rollout_engine_no_prefetch",
                 "rollout_engine_default_pool", "rollout_engine_ieee_mlp_lora",
                 "rollout_engine_lora_reductions", "rollout_engine_parts_apart", "rollout_engine_a_reductions",
                 "rollout_engine_tf32x3_lora", "rollout_engine_epilogue_all")}
    assert {(row["model"], row["method"]) for row in rows} == expected
    for row in rows:
        assert "error" not in row, row
        assert row["tokens"] == 4 * 6  # fixed lengths: min_new_tokens = max_new_tokens
        assert 0 < row["tokens_per_s"] < row["decode_limit_tokens_per_s"]
        assert row["amortised_tokens_per_s"] <= row["tokens_per_s"] + 1e-9
    table = (tmp_path / "r.md").read_text()
    assert table.count("| 4x6 |") == len(rows)
    assert "x TRL default" in table and "% of decode limit" in table and "Decode limit" in table
    assert table.strip() in capsys.readouterr().out
    engine_rows = [row for row in rows if row["method"] == "rollout_engine"]
    assert all(row["engine"]["decode_ms_per_step"] > 0 and row["engine"]["captures"] == 0 for row in engine_rows)
    assert "rollout_engine 4x6 lora: capture+compile" in table

    merged = bench.main(["--from-json", str(tmp_path / "r.json"), str(tmp_path / "r.json")])
    assert len(merged["rows"]) == 2 * len(rows)
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["device"].startswith("CPU")


def test_cache_len_sizes_the_static_cache_and_gqa_rows_run_beside_plain_ones(bench, tmp_path):
    methods = "static_compile_gqa,static_compile,trl_default,rollout_engine"
    result = bench.main(["--smoke", "--models", "lora", "--methods", methods, "--cache-len", "40", "--warmup-tokens", "2",
                         "--lora-targets", "all-linear", "--out", str(tmp_path / "r.md")])  # fmt: skip
    assert [row["method"] for row in result["rows"]] == methods.split(",")
    assert all("error" not in row for row in result["rows"]) and result["meta"]["cache_len"] == 40
    assert "static cache length 40" in (tmp_path / "r.md").read_text()


def test_decode_floor_counts_weights_per_step_and_the_growing_cache(bench):
    # 2 sequences, 3 new tokens, prompt 4: weights read 3 times; cached tokens 2 * (4 + 5 + 6) = 30
    seconds = bench.decode_floor_seconds(weight_bytes=100, kv_bytes=10, shape=(2, 3), prompt_length=4, bandwidth=1.0)
    assert seconds == 3 * 100 + 30 * 10


def test_bad_shape_is_rejected_before_any_model_is_built(bench):
    with pytest.raises(SystemExit, match="SEQUENCESxNEW_TOKENS"):
        bench.main(["--shapes", "32by256"])
    with pytest.raises(SystemExit, match="multiple of --num-prompts"):
        bench.main(["--shapes", "33x8"])
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--methods", "vllm"])


def test_inductor_presets_after_an_engine_method(bench):
    assert bench.split_presets("rollout_engine") == ("rollout_engine", None)
    assert bench.split_presets("rollout_engine_unfolded@pdl+nocombo") == (
        "rollout_engine_unfolded", {"triton.enable_pdl": True, "combo_kernels": False})
    with pytest.raises(SystemExit, match="presets go after a rollout_engine method"):
        bench.split_presets("rollout_engine@fast")
    with pytest.raises(SystemExit, match="presets go after a rollout_engine method"):
        bench.split_presets("static_compile@pdl")


def test_isolate_runs_each_method_in_a_process_of_its_own(bench, tmp_path):
    """`--isolate`: one fresh process per method (an engine compiled after another in one process ran slower on the
    GPU), their rows in one table, and the parent's own options passed on."""
    result = bench.main(["--smoke", "--isolate", "--models", "base", "--methods", "trl_default,rollout_engine",
                         "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md")])  # fmt: skip
    assert [row["method"] for row in result["rows"]] == ["trl_default", "rollout_engine"]
    assert all("error" not in row and row["tokens"] == 4 * 6 for row in result["rows"])
    pids = result["meta"]["pid"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "r.md").read_text().count("| 4x6 | base |") == 2


def test_without_options_drops_the_parents_per_run_options(bench):
    argv = ["--smoke", "--methods", "a,b", "--json=x.json", "--out", "t.md", "--isolate", "--repeats", "3"]
    assert bench.without_options(argv, {"--methods", "--json", "--out"}) == ["--smoke", "--repeats", "3"]


def test_fresh_compiles_give_each_run_a_process_and_an_inductor_cache_of_its_own(bench, tmp_path):
    """`--fresh-compiles 2`: every method twice, interleaved, each process with its own empty inductor cache (one
    compile's kernel choices can move a row by several percent); rows carry their round and the table their spread."""
    result = bench.main(["--smoke", "--models", "lora", "--methods", "rollout_engine", "--fresh-compiles", "2",
                         "--out", str(tmp_path / "r.md")])  # fmt: skip
    rows = result["rows"]
    assert [(row["method"], row["compile"]) for row in rows] == [("rollout_engine", 1), ("rollout_engine", 2)]
    assert all("error" not in row for row in rows)
    meta = result["meta"]
    assert len(set(meta["pid"])) == 2 and os.getpid() not in meta["pid"]
    caches = meta["inductor_cache"]
    assert len(set(caches)) == 2 and all(cache and "inductor_" in cache for cache in caches)
    table = (tmp_path / "r.md").read_text()
    assert "| rollout_engine (compile 2) |" in table and "Compile spread" in table
    assert "4x6 lora rollout_engine: median" in table and "(2 compiles)" in table
    assert bench.isolated_jobs(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]  # methods interleaved


def test_fresh_compiles_refuse_shared_processes_and_negative_counts(bench):
    with pytest.raises(SystemExit, match="drop --no-isolate"):
        bench.main(["--smoke", "--fresh-compiles", "2", "--no-isolate"])
    with pytest.raises(SystemExit, match=">= 0"):
        bench.main(["--smoke", "--fresh-compiles", "-1"])


def test_replay_steps_are_decode_steps_from_one(bench):
    """`--replay-steps`: the graph replays' starting decode steps, comma separated; 0 or none is refused."""
    import argparse

    assert bench._step_list("1,3072, 6000") == (1, 3072, 6000)
    with pytest.raises(SystemExit, match=r"--replay-steps: \[4000\] start too late for 32x4096.*3968 or earlier"):
        bench.main(["--shapes", "32x4096", "--methods", "rollout_engine", "--replay-steps", "1,2048,4000"])
    for bad in ("0,5", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="decode steps from 1"):
            bench._step_list(bad)
