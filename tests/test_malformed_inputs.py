"""Every file the CLI reads is parsed defensively (issue 37, item 3): a malformed one ends in a message naming the file,
what is wrong and how to go on, with exit 2, never a traceback (exit 1).

* Recipes given to `validate`, `train` and `launch` (binary bytes, nesting too deep), and `launch --config_file` of a
  missing file: refused before anything loads.
* `convert` inputs: binary and UTF-16 files, `reward_funcs` of the wrong type, deep nesting, the size cap (a file of
  unknown keys is answered in bounded time), `-o` naming a folder or a path in a missing folder, and YAML keys `1:`
  and `true:`, which are not duplicates (PyYAML makes them 1 and True, which Python takes for one key).
* Run files of a real run killed after its first checkpoint: `prorl_state.json`, `.prorl_manifest.json` (also a folder
  in its place), `prorl_trackers.json` (damaged, and recording a folder outside the run), with `--resume` and
  `--overwrite`; paths recorded in run files never lead out of the run folder.
* A fuzz test (seed 37) over recipes, `convert` inputs, `prorl_state.json`, the manifest, the trackers file,
  `resume_history.yaml`, `recipe.yaml` and `data_files.json`: random bytes, wrong YAML/JSON types, deep nesting and
  damaged copies of the real files. Each case runs through `prorl_trl.cli.main` (what `python -m prorl_trl` calls) in
  this process and must exit 0 or 2 within its time bound; a few run as real CLI processes too.
Cost: one training run killed at its second step, 5 CLI processes, ~100 in-process cases: ~100 s on 2 shared
cores at load 1.5 (~145 s at load 4), a quarter of it the killed run and ~15 s the first import of TRL.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume_cli import RECIPE, SHAPE, cli

from prorl_trl.cli import main
from prorl_trl.files import MAX_DEPTH, RECIPE_MAX_BYTES
from prorl_trl.reset.provenance import RunFilesError, resolve_in_run, verify_files
from prorl_trl.trainer.manifest import read_manifest, tensorboard_folder_in

REPO = Path(__file__).resolve().parent.parent
SHORT = ["--phases.0.max_steps", "2", "--phases.1.max_steps", "2", "--validation.eval_steps", "100"]
TRACKED = ["--training.report_to", "[tensorboard]"]  # the run records its TensorBoard folder in prorl_trackers.json
STATE = "phase-0/checkpoint-1/prorl_state.json"
DEEP_JSON = b"[" * 200_000 + b"]" * 200_000
BINARY = b"\x00\xff\xfe\x01\x80binary\x00"
CASE_SECONDS = 30  # one in-process case (PyYAML reads a 1 MiB file in ~10 s on a loaded 2-core machine)


def run_cli(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "prorl_trl", *argv]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=environment, timeout=timeout)


def in_process(*argv: str) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of `prorl_trl.cli.main(argv)`, as `python -m prorl_trl` runs it; an exception
    that escapes it (a traceback: exit 1 in a real process) fails the test with its type and message."""
    err, started = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(list(argv))
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code if isinstance(stop.code, int) else 1
    except Exception as error:  # noqa: BLE001 - reported as the traceback a user would see
        pytest.fail(f"{argv}: {type(error).__name__}: {str(error)[:300]} (a traceback, exit 1)")
    return code, err.getvalue(), time.monotonic() - started


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for word in words:
        assert word in result.stderr, (word, result.stderr[-2000:])


def register_token_hash(monkeypatch) -> None:
    """The reward of tests/_kill_launcher.py, for in-process runs against the killed run's recipe; registered for
    this test only (the registry is process-wide: a name left there reaches later tests' `rewards.available()`)."""
    import _kill_launcher
    import rewards
    from rewards import registry

    monkeypatch.setattr(registry, "_USER_REWARDS", dict(registry._USER_REWARDS))
    if "token_hash" not in rewards.available():
        rewards.register("token_hash")(_kill_launcher.token_hash)


@pytest.fixture(scope="module")
def killed_run(tiny_dir, shared_data, tmp_path_factory) -> Path:
    """A real run (2 + 2 steps, TensorBoard) killed before its second step: phase-0/checkpoint-1 is committed."""
    out = tmp_path_factory.mktemp("malformed") / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, *TRACKED, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / STATE).is_file() and (out / "prorl_trackers.json").is_file() and (out / ".prorl_manifest.json").is_file()
    return out


def resume_argv(out: Path, tiny_dir: Path, *flags: str) -> list[str]:
    """`validate` of the killed run's recipe with `flags`: the run-folder checks of `train`, nothing loaded."""
    recipe = ["--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out), *SHAPE, *SHORT, *TRACKED]
    return ["validate", RECIPE, *recipe, *flags, "--no-machine-checks"]


@contextlib.contextmanager
def damaged(path: Path, content: bytes | None):
    """`path` holding `content` (None: a folder in its place) for the block, then its own bytes again."""
    original = path.read_bytes() if path.is_file() else None
    if path.is_dir():
        shutil.rmtree(path)
    path.unlink(missing_ok=True)
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    try:
        yield
    finally:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        if original is not None:
            path.write_bytes(original)


def test_unreadable_recipes_and_launch_configs_are_refused_before_anything_loads(tmp_path):
    """Audit findings: a binary recipe given to validate/train/launch, and `launch --config_file nope.yaml`, ended in a
    traceback (UnicodeDecodeError; accelerate's FileNotFoundError)."""
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(BINARY)
    assert_refused(run_cli("validate", str(binary)), str(binary), "is not text")
    assert_refused(run_cli("launch", "--config_file", "nope.yaml", "train", RECIPE), "nope.yaml", "does not exist")
    code, err, _ = in_process("train", str(binary))
    assert code == 2 and "is not text" in err, err
    code, err, _ = in_process("launch", "train", str(binary))
    assert code == 2 and "is not text" in err, err
    deep = tmp_path / "deep.yaml"
    deep.write_bytes(b"model: " + DEEP_JSON)
    code, err, _ = in_process("validate", str(deep))
    assert code == 2 and "nests deeper than 100 levels" in err, err
    config = tmp_path / "accelerate.yaml"
    config.write_bytes(BINARY)
    code, err, _ = in_process("launch", "--config_file", str(config), "train", RECIPE)
    assert code == 2 and "cannot read the launch config" in err, err


def test_convert_answers_every_malformed_file(tmp_path):
    """Audit findings for `convert`: TypeErrors for `reward_funcs: [[accuracy]]` and `reward_funcs: 5`, tracebacks for
    binary, UTF-16 and deeply nested files and for `-o` naming a folder or a path in a missing folder, no answer in
    300 s for 8 MB of unknown keys, and `1:`/`true:` reported as duplicate keys."""
    def write(name: str, content: bytes) -> str:
        (tmp_path / name).write_bytes(content)
        return str(tmp_path / name)

    nested = write("nested.yaml", b"reward_funcs: [[accuracy]]\n")
    result = run_cli("convert", nested)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "not translated: reward_funcs: [['accuracy']] is not a reward name or a list of them" in result.stderr
    code, err, _ = in_process("convert", write("number.yaml", b"reward_funcs: 5\nlearning_rate: 1.0e-6\n"))
    assert code == 0 and "reward_funcs: 5 is not a reward name" in err, err
    code, err, _ = in_process("convert", write("binary.yaml", BINARY))
    assert code == 2 and "binary.yaml" in err and "is not text" in err, err
    out = tmp_path / "from_utf16.yaml"  # UTF-16 with its byte-order mark is text: read as such
    code, err, _ = in_process("convert", write("utf16.yaml", "learning_rate: 1.0e-6\n".encode("utf-16")), "-o", str(out))
    assert code == 0 and "learning_rate: 1.0e-06" in out.read_text(), err
    code, err, seconds = in_process("convert", write("deep.yaml", b"learning_rate: " + DEEP_JSON))
    assert code == 2 and "nests deeper than 100 levels" in err and seconds < 5, (seconds, err)
    for target, words in ((tmp_path, "is a folder"), (tmp_path / "missing" / "r.yaml", "which does not exist")):
        code, err, _ = in_process("convert", nested, "-o", str(target))
        assert code == 2 and words in err and "Nothing was written" in err, err
    keys = write("keys.yaml", b"1: a\ntrue: b\n")  # two YAML keys, one Python key (1 == True): said so, not "duplicate"
    code, err, _ = in_process("convert", keys)
    assert code == 2 and "duplicate" not in err and "different YAML keys (int and bool)" in err, err
    code, err, _ = in_process("convert", write("duplicate.yaml", b"seed: 1\nseed: 2\n"))
    assert code == 2 and "duplicate key 'seed'" in err, err
    code, err, _ = in_process("convert", write("unhashable.yaml", b"? [a, b]\n: 1\n"))
    assert code == 2 and "unhashable key" in err, err
    code, err, seconds = in_process("convert", write("huge.yaml", b"k: 1\n" * (RECIPE_MAX_BYTES // 5 + 1)))
    assert code == 2 and "more than the 1 MiB" in err and seconds < 5, (seconds, err)
    many = write("many.yaml", "".join(f"unknown_key_{index}: {index}\n" for index in range(5000)).encode())
    code, err, seconds = in_process("convert", many)  # a did-you-mean for each of 5000 keys took minutes
    assert code == 0 and err.count("not translated: unknown_key_") == 5000 and seconds < 20, seconds


def test_damaged_run_files_are_refused_before_anything_loads(killed_run, tiny_dir, shared_data, monkeypatch):
    """Audit findings: a `prorl_state.json` that is not a JSON object, a manifest that is a folder or nested 200,000
    levels deep, and a damaged `prorl_trackers.json` ended in tracebacks with `--resume` (and `--overwrite`)."""
    monkeypatch.setenv("PRORL_SHARED_DATA", str(shared_data))
    monkeypatch.chdir(REPO)
    register_token_hash(monkeypatch)
    out = killed_run
    with damaged(out / STATE, b"[1, 2]"):  # through `train` itself: refused before the model loads
        result = cli(out, tiny_dir, shared_data, *SHORT, *TRACKED, "--resume")
        assert_refused(result, str(out / STATE), "holds a list, not a mapping", "--overwrite")
        assert not (out / "run_summary.json").exists()
    cases = [
        (STATE, b"{not json", "is not valid JSON"), (STATE, b'"a string"', "holds a string"),
        (STATE, b'{"phase_index": "1"}', "phase_index, phase_global_step"), (STATE, DEEP_JSON, "nests too deeply"),
        (".prorl_manifest.json", None, "is a folder, not a file"), (".prorl_manifest.json", DEEP_JSON, "nests too deeply"),
        ("prorl_trackers.json", None, "is a folder"), ("prorl_trackers.json", BINARY, "is not text"),
        ("prorl_trackers.json", b'{"tensorboard": ["runs"]}', "tensorboard not text"),
    ]  # fmt: skip
    for name, content, words in cases:
        with damaged(out / name, content):
            code, err, _ = in_process(*resume_argv(out, tiny_dir, "--resume"))
            assert code == 2 and str(out / name) in err and words in err, (name, err)
            code, err, _ = in_process(*resume_argv(out, tiny_dir, "--overwrite"))
            if name == ".prorl_manifest.json":  # what is the run's cannot be told: nothing is deleted
                assert code == 2 and str(out / name) in err and "delete it" in err, (name, err)
            else:  # the run's outputs are known: --overwrite may delete them
                assert code == 0 and "would delete the outputs" in err, (name, err)
    code, err, _ = in_process(*resume_argv(out, tiny_dir, "--resume"))  # every file restored: the run resumes
    assert code == 0 and "resuming from" in err, err


def test_paths_recorded_in_run_files_never_leave_the_run_folder(tmp_path):
    """`prorl_state.json`'s `frozen_factors`/`merged_base` and its sha256 keys, the manifest's paths and the
    TensorBoard folder of `prorl_trackers.json` are read inside the run folder only (`runs/..` was the first case)."""
    run, checkpoint = tmp_path / "run", tmp_path / "run" / "phase-1" / "checkpoint-1"
    (run / "runs" / "May01").mkdir(parents=True)
    (tmp_path / "other" / "merged").mkdir(parents=True)
    with pytest.raises(RunFilesError, match="leads out of the run folder"):
        resolve_in_run("../other/merged", run, checkpoint, "merged_base")
    with pytest.raises(RunFilesError, match="not a path"):
        resolve_in_run(["merged"], run, checkpoint, "merged_base")
    with pytest.raises(RunFilesError, match="outside the run folder"):
        verify_files({"../other/merged/model.safetensors": "0" * 64}, run, checkpoint, "the merged base")
    assert tensorboard_folder_in(run, "runs/May01") == run / "runs" / "May01"
    for outside in ("runs/..", "../other", str(tmp_path / "other"), "/"):
        assert tensorboard_folder_in(run, outside) is None, outside
    (run / ".prorl_manifest.json").write_text(json.dumps({"paths": ["../other/", "/etc/", "runs/May01/", 5]}))
    assert read_manifest(run) == ["runs/May01/"]


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "list", "dict"] if depth < 4 else ["int", "str", "null"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        keys = ["phase_index", "paths", "tensorboard", "model", "training", "rewards", "reward_funcs", "data", "x"]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {"int": rng.randint(-5, 10**6), "float": rng.random(), "str": rng.choice(["", "a", "../x", "1e-6"]),
            "bool": rng.random() < 0.5, "null": None}[kind]  # fmt: skip


def fuzz_payloads(rng: random.Random, original: bytes, count: int, deep: bytes) -> list[bytes | None]:
    """Random bytes, random YAML/JSON values of every type, `deep` nesting, a folder, and damaged copies of `original`
    (bytes flipped, cut short, one value of it replaced by a random one)."""
    payloads: list[bytes | None] = [None, b"", deep, json.dumps(_deep_dict(MAX_DEPTH + 5)).encode()]
    while len(payloads) < count:
        roll = rng.random()
        if roll < 0.2:
            payloads.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))))
        elif roll < 0.5:
            payloads.append(json.dumps(_random_value(rng)).encode())
        elif roll < 0.7 and original:
            data = bytearray(original)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            payloads.append(bytes(data[: rng.randint(1, len(data))]) if rng.random() < 0.5 else bytes(data))
        else:
            payloads.append(_replace_one_value(rng, original))
    return payloads


def _deep_dict(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _replace_one_value(rng: random.Random, original: bytes) -> bytes:
    """`original` (JSON or YAML) with the value of one random top-level key replaced by a random value."""
    import yaml

    try:
        loaded = yaml.safe_load(original)
    except yaml.YAMLError:
        loaded = None
    if not isinstance(loaded, dict) or not loaded:
        return json.dumps(_random_value(rng)).encode()
    loaded[rng.choice(sorted(map(str, loaded)))] = _random_value(rng)
    return json.dumps(loaded, default=str).encode()


def test_fuzz_every_file_the_cli_reads_exits_0_or_2(killed_run, tiny_dir, shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORL_SHARED_DATA", str(shared_data))
    monkeypatch.chdir(REPO)
    register_token_hash(monkeypatch)
    rng = random.Random(37)
    out = killed_run
    (out / "resume_history.yaml").write_text("")  # an empty history, to be damaged like the others
    recipe, config = tmp_path / "recipe.yaml", tmp_path / "open_r1.yaml"
    open_r1 = (b"model_name_or_path: Qwen/Qwen2.5-0.5B\nreward_funcs: [accuracy, format]\nreward_weights: [1.0, 0.5]\n"
               b"learning_rate: 1.0e-6\nuse_peft: true\nlora_r: 8\ndataset_name: x/y\n")  # fmt: skip
    targets = [  # (file to damage, its own bytes, the command that reads it)
        (recipe, Path(RECIPE).read_bytes(), ["validate", str(recipe), "--no-machine-checks"]),
        (config, open_r1, ["convert", str(config)]),
        *((out / name, (out / name).read_bytes(), resume_argv(out, tiny_dir, flag)) for name, flag in (
            (STATE, "--resume"), (".prorl_manifest.json", "--overwrite"), ("prorl_trackers.json", "--resume"),
            ("resume_history.yaml", "--resume"), ("recipe.yaml", "--resume"), ("data_files.json", "--resume"),
        )),
    ]  # fmt: skip
    outcomes: dict[str, dict[int, int]] = {}
    for path, original, argv in targets:
        for payload in fuzz_payloads(rng, original, 10, DEEP_JSON if path.suffix == ".json" else b"a: " + DEEP_JSON):
            with damaged(path, payload):
                code, err, seconds = in_process(*argv)
            case = (path.name, (payload or b"<folder>")[:60])
            assert code in (0, 2) and "Traceback" not in err, (case, code, err[-1500:])
            assert seconds < CASE_SECONDS, (case, seconds)
            outcomes.setdefault(path.name, {}).setdefault(code, 0)
            outcomes[path.name][code] += 1
    assert all(2 in codes for codes in outcomes.values()), outcomes  # every file had cases that were refused
    recipe.write_bytes(_replace_one_value(rng, Path(RECIPE).read_bytes()))  # one more, as a real process
    result = run_cli("validate", str(recipe), "--no-machine-checks")
    assert result.returncode in (0, 2) and "Traceback" not in result.stderr, result.stderr[-2000:]
