"""benchmarks/e2e_gpu.py --smoke: the end-to-end launch, kill and resume of the GSM8K recipe on CPU (~40 s)."""

from _benchmarks import load_benchmark


def test_e2e_smoke_kills_resumes_and_passes_every_check(tmp_path, shared_data):
    table = load_benchmark("e2e_gpu").main(
        ["--smoke", "--data", str(shared_data / "gsm8k"), "--workdir", str(tmp_path), "--out", str(tmp_path / "e2e.md")]
    )
    checks = table.split("| check | result |")[1]
    assert "**no**" not in checks, checks
    for check in ("killed mid-phase after reset 1", "resumed run exit status 0", "ended in the last phase with 4 resets",
                  "final/ loads with from_pretrained", "TensorBoard events hold every phase"):  # fmt: skip
        assert check in checks
    assert "(0, 0), (3, 1), (6, 2), (9, 3), (12, 4)" in checks
    assert (tmp_path / "e2e.md").read_text().strip() == table.strip()
