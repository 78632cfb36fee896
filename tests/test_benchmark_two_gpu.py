"""The 2-GPU benchmark's CPU smoke mode (gloo): it must keep running, and replicas must be identical after resets."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_two_gpu_benchmark_smoke(tmp_path):
    out = tmp_path / "two_gpu.md"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "two_gpu.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == "1"  # one hard reset (the phase boundary)
        assert cells[2] == "8"  # the phase-1 adapter rank: the reset changed the LoRA shape
        assert cells[3].startswith("yes")
