"""benchmarks/frozen_parts.py on the tiny model: one part per reset against joined parts, timed."""

from _benchmarks import load_benchmark

frozen_parts = load_benchmark("frozen_parts")


def test_smoke_times_separate_and_joined_parts(tmp_path, capsys):
    rows = frozen_parts.main(["--smoke", "--out", str(tmp_path / "table.md")])
    assert [row["resets"] for row in rows] == [0, 2]
    assert (rows[0]["parts_separate"], rows[0]["parts_joined"]) == (0, 0)
    assert (rows[1]["parts_separate"], rows[1]["parts_joined"]) == (2, 1)  # two resets, joined into one part
    assert all(row["separate"] > 0 and row["joined"] > 0 for row in rows)
    table = (tmp_path / "table.md").read_text()
    assert "| 2 | 2, " in table and "joined / separate" in table and table in capsys.readouterr().out + "\n"
