"""`benchmarks/decode_gemm_chain.py --smoke`: the chain of projections runs on CPU (torch ops) and the table is formed."""

import pytest
import torch
from _benchmarks import load_benchmark


def test_smoke_run_times_every_projection_and_renders_the_table(tmp_path):
    bench = load_benchmark("decode_gemm_chain")
    rows = bench.main(["--smoke", "--out", str(tmp_path / "chain.md")])
    assert [row["method"] for row in rows] == ["cublas"]  # on CPU: torch's matmul stands in for cuBLAS
    row = rows[0]
    assert "error" not in row, row
    assert row["max_relative_error"] < 1e-5  # float32 on CPU against float32 products
    assert row["us_per_layer"] > 0 and all(row[name] > 0 for name in ("qkv", "o", "gate_up", "down"))
    table = (tmp_path / "chain.md").read_text()
    assert "| method | all four | GB/s | qkv | o | gate_up | down | max relative error |" in table
    assert "| cublas |" in table and "2 layers" in table


def test_chain_feeds_each_projection_the_previous_output():
    bench = load_benchmark("decode_gemm_chain")
    x, weights, outputs = bench.build(4, torch.device("cpu"), torch.float32, layers=2, scale=16)
    calls = []

    def linear(name, source, weight, out):
        calls.append((name, source.data_ptr()))
        return torch.mm(source, weight.T, out=out)

    last = bench.chain(x, weights, outputs, linear)
    assert [name for name, _ in calls] == ["qkv", "o", "gate_up", "down"] * 2
    previous = [x.data_ptr()] + [outputs[i // 4][name].data_ptr() for i, (name, _) in enumerate(calls[:-1])]
    assert [pointer for _, pointer in calls] == previous  # every input is (a slice from the start of) the last output
    assert last.data_ptr() == outputs[1]["down"].data_ptr()
    only = bench.chain(x, weights, outputs, linear, only="down")
    assert len(only) == 2 and len({pointer for name, pointer in calls[-2:]}) == 1  # one fixed input, made once
    with pytest.raises(KeyError):
        bench.chain(x, weights, outputs, linear, only="lm_head")
