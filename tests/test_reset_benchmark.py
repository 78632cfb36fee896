"""The GPU trainer benchmark (benchmarks/trainer_gpu.py) runs end to end in its CPU smoke mode and prints its table."""

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def benchmark():
    return load_benchmark("trainer_gpu")


def test_smoke_mode_prints_one_complete_table(benchmark, tmp_path, capsys):
    out = tmp_path / "table.md"
    benchmark.main(["--smoke", "--rounds", "2", "--steps", "1", "--resets", "2", "--out", str(out)])
    table = out.read_text().strip().splitlines()
    assert capsys.readouterr().out.strip().splitlines()[-len(table):] == table
    assert table[0].startswith("| ProRLTrainer on CPU (smoke)") and table[1].startswith("| --- |")
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| step time, median of 1 steps (s)",
        "| hard_reset() in training, median / max of 2 (s)",
        "| merged save of the full model (s, disk-bound, informational)",
        "| memory allocated after reset 1 / 2 (CPU RSS MiB)",
        "| memory reserved after reset 1 / 2 (GPU MiB)",
    ]
    assert "ratio " in table[2] and all(row.count("|") == 7 for row in table)


def test_qwen2_05b_config_has_the_published_sizes(benchmark):
    from prorl_trl.tiny import build_tiny_tokenizer

    config = benchmark.qwen2_05b_config(build_tiny_tokenizer())
    sizes = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert sizes == (896, 24, 14, 2)
    assert (config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (4864, 151936, True)
