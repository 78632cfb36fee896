"""benchmarks/merge_rounding.py in its CPU smoke mode: the table it prints and the facts its rows stand for."""

from _benchmarks import load_benchmark


def test_smoke_rows_show_the_rounded_away_share_shrinking_and_float32_exact(tmp_path, capsys):
    benchmark = load_benchmark("merge_rounding")
    out = tmp_path / "table.md"
    rows = benchmark.main(["--smoke", "--out", str(out)])
    table = out.read_text().strip().splitlines()
    assert capsys.readouterr().out.strip().splitlines()[-len(table):] == table
    assert len(table) == 4 + len(rows) and all(line.count("|") == 11 for line in table[2:])
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    assert [r["steps"] for r in bf16] == list(benchmark.SMOKE_STEPS) and len(fp32) == 2
    assert all(r["adapter_effect"] > 0 for r in rows), "the adapter must have learned something to merge"
    assert bf16[0]["lost_percent"] > bf16[-1]["lost_percent"] > 0  # more training: more of the delta survives bf16
    assert all(r["lost_percent"] == 0.0 and r["reset_dlogits"] < 1e-5 for r in fp32)
    assert all(r["in_steps"] == r["reset_dlogits"] / r["spacing"] for r in rows)
    # the floor: the unchanged model under eager attention moves bf16 logits by whole bf16 steps, float32 ones by noise
    assert all(r["floor_eager"] >= r["spacing"] / 2 for r in bf16) and all(r["floor_eager"] < 1e-5 for r in fp32)


def test_bf16_spacing_is_one_step_of_an_8_bit_mantissa():
    benchmark = load_benchmark("merge_rounding")
    assert benchmark.bf16_spacing(1.0) == 2**-7 and benchmark.bf16_spacing(2.16) == 2**-6
    assert benchmark.bf16_spacing(-0.66) == 2**-8
