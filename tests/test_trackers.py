"""`report_to` trackers on a real two-phase ProRL run (tiny model): each writes one run, at continuous steps, with the
phase table as its config, the `prorl/*` metrics, the phase starts and the merged checkpoint's folder; then read back
from what the tracker wrote (TensorBoard event files, trackio's SQLite store, W&B's offline transaction log, MLflow's
local file store). One training run feeds all four (~15 s)."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import uuid

import pytest
from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model

from prorl_trl import PhaseConfig, ProRLConfig, ProRLTrainer
from prorl_trl.cli import main
from prorl_trl.recipe.trackers import check_trackers, missing_trackers

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")
OPTIONAL = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name) is not None]
PHASES = [PhaseConfig(name="explore", max_steps=2), PhaseConfig(name="sharpen", max_steps=2, temperature=0.8, lora_r=2)]


def parity(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    project = f"prorl-test-{uuid.uuid4().hex[:12]}"  # trackio's store is per user, shared across test sessions
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": str(tmp / "mlruns"), "MLFLOW_ALLOW_FILE_STORE": "true"}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        model, tokenizer = tiny_model()
        args = tiny_args(tmp, phases=PHASES, report_to=["tensorboard", "trackio", *OPTIONAL], project=project,
                         run_name="two-phases")  # fmt: skip
        trainer = ProRLTrainer(
            model=model, processing_class=tokenizer, reward_funcs=[parity], args=args,
            train_dataset=prompts_dataset(), peft_config=lora(),
        )  # fmt: skip
        trainer.train()
        if "wandb" in OPTIONAL:
            import wandb

            wandb.finish()  # HF's callback leaves the W&B run open until the process exits
    yield tmp, project, trainer
    from trackio.sqlite_storage import SQLiteStorage

    store = SQLiteStorage.get_project_db_path(project)  # trackio keeps its store under the user's cache folder
    for path in (store, store.with_suffix(".lock")):
        path.unlink(missing_ok=True)


def expected_phase_table(trainer) -> list[dict]:
    return [phase.to_phase_config().__dict__ for phase in trainer.phases]


def test_config_serialises_phases_as_plain_dicts():
    args = ProRLConfig(output_dir="unused", use_cpu=True, bf16=False, phases=PHASES)
    phases = json.loads(args.to_json_string())["phases"]
    assert phases[1] == {**{k: None for k in PhaseConfig.__dataclass_fields__}, **PHASES[1].__dict__}
    assert args.to_dict()["phases"][0]["name"] == "explore"


def test_tensorboard(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, trainer = tracked_run
    folders = sorted({p.parent for p in (tmp / "run" / "runs").rglob("events.out.tfevents.*")})
    assert len(folders) == 1  # one run for the whole ProRL run, not one per phase
    events = EventAccumulator(str(folders[0]), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]  # continuous across the phases
    assert {(e.step, e.value) for e in events.Scalars("train/prorl/phase_start")} == {(0, 0.0), (2, 1.0)}
    assert [e.value for e in events.Scalars("train/prorl/resets")][-1] == 1
    args_text = events.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(args_text)["phases"] == expected_phase_table(trainer)
    merged = events.Tensors("train/merged_checkpoint/text_summary")
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in merged] == [(2, trainer.prorl_merged_path)]


def test_trackio(tracked_run):
    from trackio.sqlite_storage import SQLiteStorage

    _, project, trainer = tracked_run
    assert SQLiteStorage.get_runs(project) == ["two-phases"]
    logs = SQLiteStorage.get_logs(project, "two-phases")
    assert [entry["train/global_step"] for entry in logs if "train/loss" in entry] == [1, 2, 3, 4]
    assert [(e["train/global_step"], e["train/prorl/phase_start"]) for e in logs if "train/prorl/phase_start" in e] == [
        (0, 0),
        (2, 1),
    ]
    assert [e["train/merged_checkpoint"] for e in logs if "train/merged_checkpoint" in e] == [
        trainer.prorl_merged_path
    ]
    config = SQLiteStorage.get_run_config(project, "two-phases")
    assert config["phases"] == expected_phase_table(trainer)


def wandb_records(path):
    """The protobuf records of a W&B `.wandb` file (LevelDB log format: 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""  # after the ":W&B" file header
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.skipif("wandb" not in OPTIONAL, reason="wandb not installed")
def test_wandb_offline(tracked_run):
    tmp, _, trainer = tracked_run
    runs = list((tmp / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history, config = [], {}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    assert [h["train/global_step"] for h in history if "train/loss" in h] == [1, 2, 3, 4]
    assert [(h["train/global_step"], h["train/prorl/phase_start"]) for h in history if "train/prorl/phase_start" in h] == [
        (0, 0),
        (2, 1),
    ]
    assert config["phases"] == expected_phase_table(trainer)


@pytest.mark.skipif("mlflow" not in OPTIONAL, reason="mlflow not installed")
def test_mlflow_local_store(tracked_run):
    from mlflow.tracking import MlflowClient

    tmp, _, trainer = tracked_run
    client = MlflowClient(str(tmp / "mlruns"))
    runs = client.search_runs(["0"])
    assert len(runs) == 1  # HF's callback ends the MLflow run at every train() call: one run per phase without ProRL
    run = runs[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "prorl/phase_start")] == [(0, 0), (2, 1)]
    assert run.data.tags["merged_checkpoint/step-2"] == trainer.prorl_merged_path
    assert "'lora_r': 2" in run.data.params["phases"] and "'sharpen'" in run.data.params["phases"]


def test_missing_tracker_names_the_extra(monkeypatch, tmp_path, capsys):
    assert missing_trackers(["tensorboard", "trackio"]) == [] and missing_trackers("all") == []
    monkeypatch.setitem(sys.modules, "trackio", None)  # importlib's "not installed"
    [problem] = check_trackers(["tensorboard", "trackio"])
    assert problem.path == "logging.report_to" and "pip install -e '.[trackers]'" in problem.message
    recipe = "tests/recipes/tiny_gsm8k.yaml"
    assert main(["validate", recipe, "--training.report_to", "[trackio]"]) == 2
    err = capsys.readouterr().err
    assert "training.report_to" in err and "`trackio`, which is not installed" in err and "[trackers]" in err
    assert main(["validate", recipe, "--training.report_to", "dvclive"]) == 2
    assert "pip install dvclive" in capsys.readouterr().err


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    """Interrupted in phase 2, resumed by a new trainer: still one run per tracker, steps 1..5 once each (W&B takes
    the recorded id the same way, through WANDB_RUN_ID; its offline mode only shows it across processes)."""
    import test_trainer_resume
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trainer_resume import Interrupt, StopAt
    from trackio.sqlite_storage import SQLiteStorage

    pytest.importorskip("mlflow")
    project = f"prorl-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    plain = test_trainer_resume.tiny_args
    monkeypatch.setattr(
        test_trainer_resume, "tiny_args",
        lambda path, **kw: plain(path, report_to=["tensorboard", "trackio", "mlflow"], project=project, **kw),
    )  # fmt: skip
    try:
        with pytest.raises(Interrupt):
            test_trainer_resume.run(tmp_path / "b", callbacks=[StopAt(3)])
        test_trainer_resume.run(tmp_path / "b", resume=True)
        [tensorboard] = {p.parent for p in (tmp_path / "b" / "run" / "runs").rglob("events.out.tfevents.*")}
        events = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
        events.Reload()
        assert sorted(e.step for e in events.Scalars("train/loss")) == [1, 2, 3, 4, 5]
        client = MlflowClient(str(tmp_path / "mlruns"))
        [run] = client.search_runs(["0"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5]
        [name] = SQLiteStorage.get_runs(project)
        assert [e["train/global_step"] for e in SQLiteStorage.get_logs(project, name) if "train/loss" in e] == [1, 2, 3, 4, 5]
    finally:
        store = SQLiteStorage.get_project_db_path(project)
        for path in (store, store.with_suffix(".lock")):
            path.unlink(missing_ok=True)


def test_a_tensorboard_folder_that_was_there_is_not_recorded_as_the_runs(tmp_path, monkeypatch):
    """`TENSORBOARD_LOGGING_DIR` inside the run folder, holding other experiments: the run's manifest took the whole
    folder, so `--overwrite` deleted the other experiments' events. Only the files the run's writer added are
    recorded now; a folder the writer makes is still the run's."""
    from prorl_trl.trainer.manifest import read_manifest

    run = tmp_path / "run"
    other = run / "tb" / "other-experiment" / "events.out.tfevents.1"
    other.parent.mkdir(parents=True)
    other.write_text("theirs")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(run / "tb"))
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, max_steps=1, report_to=["tensorboard"])
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[parity], args=args,
                           train_dataset=prompts_dataset())  # fmt: skip
    trainer.train()
    recorded = read_manifest(run)
    assert "tb/" not in recorded and "tb/other-experiment/" not in recorded
    ours = [path for path in recorded if path.startswith("tb/")]
    assert ours and all(path.startswith("tb/events.out.tfevents.") for path in ours), recorded
