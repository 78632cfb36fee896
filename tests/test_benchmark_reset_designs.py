"""benchmarks/reset_designs.py runs in its smoke mode: four reset designs on a bf16 tiny model, one table."""

from _benchmarks import load_benchmark


def test_reset_designs_smoke(capsys):
    rows = load_benchmark("reset_designs").main(["--smoke"])
    by_design = {row["design"]: row for row in rows}
    assert list(by_design) == list(load_benchmark("reset_designs").DESIGNS)
    assert by_design["frozen factors"]["kept"] == [1.0, 1.0]  # a frozen reset changes nothing
    assert all(k < 0.5 for k in by_design["merge (round to nearest)"]["kept"])  # a merge rounds the phase away
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| frozen factors | 100 %, 100 % |")
