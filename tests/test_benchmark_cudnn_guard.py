"""benchmarks/cudnn_guard.py on the CPU: the study shape on a tiny model, the guard's modes cycling per step."""

from _benchmarks import load_benchmark

cudnn_guard = load_benchmark("cudnn_guard")


def test_smoke_cycles_the_modes_and_tabulates_them(tmp_path, capsys):
    payload = cudnn_guard.main(["--smoke", "--out", str(tmp_path / "table.md")])
    assert payload["reproduction"] == [] and all(failing is None for failing, _ in payload["probes"].values())
    lengths = [result["padded_length"] for result in payload["results"]]
    assert lengths == [64, 65]  # one padded length on the guarded remainder, one past it
    for result in payload["results"]:
        assert result["modes"] == ["auto", "off", "auto", "always"] and len(result["step_seconds"]) == 4
    table = (tmp_path / "table.md").read_text()
    assert table.count("| study | 64 (") == 3 and "| always |" in table and table in capsys.readouterr().out + "\n"
