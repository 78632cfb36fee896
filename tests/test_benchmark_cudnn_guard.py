"""benchmarks/cudnn_guard.py on the CPU: the study shape on a tiny model, the guard's modes cycling per step."""

import pytest
from _benchmarks import load_benchmark

cudnn_guard = load_benchmark("cudnn_guard")


def test_smoke_cycles_the_modes_and_tabulates_them(tmp_path, capsys):
    payload = cudnn_guard.main(["--smoke", "--out", str(tmp_path / "table.md"), "--json", str(tmp_path / "run.json")])
    assert payload["reproduction"] == [] and all(failing is None for failing, _ in payload["probes"].values())
    lengths = [result["padded_length"] for result in payload["results"]]
    assert lengths == [64, 65]  # one padded length on the guarded remainder, one past it
    for result in payload["results"]:
        assert result["modes"] == ["auto", "off", "auto", "always"] and len(result["step_seconds"]) == 4
    table = (tmp_path / "table.md").read_text()
    assert table.count("| study | 64 (") == 3 and "| always |" in table and table in capsys.readouterr().out + "\n"


def test_report_joins_runs_made_apart_and_refuses_an_unknown_length(tmp_path, capsys):
    """`--report`: the cost tables of runs made on different GPUs (one `--lengths` each) as one table, each device
    named; an unknown `--lengths` is refused before any work."""
    cudnn_guard.main(["--smoke", "--lengths", "unguarded", "--json", str(tmp_path / "unguarded.json")])
    payload = cudnn_guard.main(["--report", str(tmp_path / "unguarded.json"), "--out", str(tmp_path / "joined.md")])
    assert [result["padded_length"] for p in payload["payloads"] for result in p["results"]] == [65]
    joined = (tmp_path / "joined.md").read_text()
    assert "- unguarded.json: CPU (smoke)" in joined and joined.count("| study | 65 (") == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cudnn_guard.main(["--smoke", "--lengths", "guarded,sideways"])
    assert stop.value.code == 2 and "--lengths" in capsys.readouterr().err
