"""Checkpoint files are checked on resume (issue 37).

* `record_checkpoint_hashes` / `verify_checkpoint` directly: a checkpoint's files (and the `prorl_state.json` about
  to commit it) are hashed at save; a flipped byte, a truncated file, a missing file, a folder where a file was and a
  damaged hashes file are refused naming the file and the checkpoint before it; a checkpoint without hashes (written
  before they were recorded) passes with a note.
* Through `prorl-trl train`: one run killed after its reset-1 checkpoint, then `--resume` with, in turn, a flipped
  byte in adapter_model.safetensors, optimizer.pt truncated, scheduler.pt replaced by a folder, and
  frozen/reset-1.safetensors deleted and then replaced by a folder: each exits 2 naming the file, without a
  traceback; with the files put back the resume finishes (exit 0). 7 CLI processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_portable_runs import AFTER_RESET_1, SHORT
from test_resume_cli import cli

from prorl_trl.reset.checkpoint import (
    CHECKPOINT_HASHES_NAME,
    PRORL_STATE_NAME,
    record_checkpoint_hashes,
    verify_checkpoint,
)
from prorl_trl.reset.provenance import RunFilesError


def _fake_checkpoint(run: Path, step: int) -> Path:
    """A committed checkpoint as `ProRLStateCallback.on_save` leaves it: HF's files, the hashes, the commit record."""
    checkpoint = run / "phase-0" / f"checkpoint-{step}"
    (checkpoint / "sharded").mkdir(parents=True)
    (checkpoint / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
    (checkpoint / "optimizer.pt").write_bytes(b"optimizer state" * 100)
    (checkpoint / "sharded" / "rank0.distcp").write_bytes(b"shard")
    (checkpoint / ".prorl_state.json.tmp").write_text("{")  # a killed earlier write's leftover: not part of the save
    commit = json.dumps({"phase_index": 0, "phase_global_step": step})
    record_checkpoint_hashes(checkpoint, commit)
    (checkpoint / PRORL_STATE_NAME).write_text(commit)
    return checkpoint


def test_record_and_verify_checkpoint_hashes(tmp_path):
    first, checkpoint = _fake_checkpoint(tmp_path, 1), _fake_checkpoint(tmp_path, 2)
    recorded = json.loads((checkpoint / CHECKPOINT_HASHES_NAME).read_text())["files"]
    assert sorted(recorded) == ["adapter_model.safetensors", "optimizer.pt", PRORL_STATE_NAME, "sharded/rank0.distcp"]
    assert verify_checkpoint(checkpoint) is None

    def refused(path: Path, problem: str) -> str:
        with pytest.raises(RunFilesError) as error:
            verify_checkpoint(checkpoint)
        message = str(error.value)
        assert message.startswith(f"{path} {problem}"), message
        assert f"--resume {first.resolve()}" in message and "nothing was loaded" in message
        return message

    adapter = checkpoint / "adapter_model.safetensors"
    pristine = adapter.read_bytes()
    flipped = bytearray(pristine)
    flipped[500] ^= 1
    adapter.write_bytes(bytes(flipped))
    refused(adapter, "changed since the save")
    adapter.write_bytes(pristine[:-1])
    refused(adapter, "has 1023 bytes, the save wrote 1024 (truncated")
    adapter.unlink()
    refused(adapter, "is missing")
    adapter.mkdir()
    refused(adapter, "is a folder")
    adapter.rmdir()
    adapter.write_bytes(pristine)
    (checkpoint / PRORL_STATE_NAME).write_text("{}")
    refused(checkpoint / PRORL_STATE_NAME, "has 2 bytes")
    for damaged in ("{", '{"files": {"optimizer.pt": "0"}}'):
        (checkpoint / CHECKPOINT_HASHES_NAME).write_text(damaged)
        refused(checkpoint / CHECKPOINT_HASHES_NAME, "is damaged")
    with pytest.raises(RunFilesError, match="--overwrite"):  # the first checkpoint has none before it
        (first / "optimizer.pt").write_bytes(b"")
        verify_checkpoint(first)
    (checkpoint / CHECKPOINT_HASHES_NAME).unlink()  # a checkpoint from before hashes were recorded
    assert "has no prorl_checkpoint_hashes.json" in verify_checkpoint(checkpoint)


# ---------------------------------------------------------------------------------------------------- CLI runs
def test_damaged_checkpoint_files_are_refused_and_restored_files_resume(tiny_dir, shared_data, tmp_path):
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env=AFTER_RESET_1)
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoint = out / "phase-1" / "checkpoint-1"
    hashed = json.loads((checkpoint / CHECKPOINT_HASHES_NAME).read_text())["files"]
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                 PRORL_STATE_NAME):  # fmt: skip
        assert name in hashed, name
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine)

    def flip_byte(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the tensors: the file still loads, with another weight
        path.write_bytes(bytes(data))

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def folder(path: Path) -> None:
        path.unlink()
        path.mkdir()

    frozen = out / "frozen" / "reset-1.safetensors"
    cases = [
        (checkpoint / "adapter_model.safetensors", flip_byte, "changed since the save"),
        (checkpoint / "optimizer.pt", truncate, "truncated"),
        (checkpoint / "scheduler.pt", folder, "is a folder"),
        (frozen, Path.unlink, "which is missing"),
        (frozen, folder, "which is a folder"),
    ]
    for path, damage, problem in cases:
        damage(path)
        refused = cli(out, tiny_dir, shared_data, *SHORT, "--resume")
        assert refused.returncode == 2, (path, refused.stderr[-3000:])
        assert str(path) in refused.stderr and problem in refused.stderr, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr and "--resume" in refused.stderr, refused.stderr[-3000:]
        if path.is_dir():
            path.rmdir()
        shutil.copy2(pristine / path.relative_to(out), path)
    resumed = cli(out, tiny_dir, shared_data, *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()
    assert verify_checkpoint(out / "phase-1" / "checkpoint-2") is None  # the resumed run's checkpoints are hashed too
