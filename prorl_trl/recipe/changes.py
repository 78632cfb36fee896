"""Changed resumes: what `--resume` does when the recipe differs from the one the run was started with.

A run's `recipe.yaml` is the effective recipe (after overrides) of its first start and is never rewritten by a
resume. A resume compares its own effective recipe with that one plus the changes accepted by earlier resumes
(`resume_history.yaml`). A change that alters training (the learning rate, a phase's length, the data, ...) is
refused before anything is loaded, listing each key `old -> new`, unless `--allow-changes` confirms it: a run half
trained one way and half another is not the experiment its recipe describes. Changes that only say where metrics go
or how the run is named (`LOGGING_ONLY`) pass. Every change a resume went on with is appended to the history.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..trainer.manifest import read_manifest
from .schema import SECTIONS, RecipeError, RewardSpec

RECORDED_RECIPE_NAME = "recipe.yaml"
RESUME_HISTORY_NAME = "resume_history.yaml"
DATA_FILES_NAME = "data_files.json"  # what the local data files held (`prorl_trl.data.fingerprint`)
DATA_FILE_KEY = "data file"  # how a changed data file is named among the changes (`data file (train) <path>`)

# Keys (flattened, `section.key`; patterns as `fnmatch`) whose change leaves the trained weights as they were: where
# metrics go, how often they are written and how the run is named, how checkpoints are kept and where the run folder
# is (a moved run is resumed with its new `output_dir`), data-loader workers (the sampler, not the workers, orders the
# data). Everything else, validation included (its generations draw from the RNG the training run draws from), is
# taken as altering training.
LOGGING_ONLY = (
    "description",
    "logging.*",
    "training.output_dir",
    "training.overwrite_output_dir",
    "training.resume_from_checkpoint",
    "training.report_to",
    "training.run_name",
    "training.project",
    "training.trackio_*",
    "training.logging_*",
    "training.log_level*",
    "training.log_on_each_node",
    "training.disable_tqdm",
    "training.log_completions",
    "training.num_completions_to_print",
    "training.log_unique_prompts",
    "training.save_steps",
    "training.save_strategy",
    "training.save_total_limit",
    "training.push_to_hub",
    "training.hub_*",
    "training.dataloader_num_workers",
    "training.dataloader_pin_memory",
    "training.dataloader_persistent_workers",
    "training.dataloader_prefetch_factor",
)
# When the plateau rule watches a training metric (not `eval_*`), how often it is logged decides when a phase ends.
# The recipes set it under `logging:` (and `--training.logging_steps` lands there).
_LOGGING_FREQUENCY = (
    "logging.logging_steps", "training.logging_steps", "training.logging_strategy", "training.logging_first_step"
)
_UNSET = object()


@dataclass(frozen=True)
class Change:
    """One recipe key whose value differs from the run's recorded recipe (`_UNSET`: not in that recipe)."""

    key: str
    old: Any
    new: Any
    alters_training: bool

    def describe(self) -> str:
        return f"{self.key}: {_shown(self.old)} -> {_shown(self.new)}"

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"key": self.key}
        if self.old is not _UNSET:
            record["old"] = self.old
        if self.new is not _UNSET:
            record["new"] = self.new
        record["alters_training"] = self.alters_training
        return record


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "(not set)"
    return json.dumps(value, default=str) if not isinstance(value, str) else value


def flatten(raw: Any, prefix: str = "") -> dict[str, Any]:
    """A recipe as `{dotted.key: value}`: mappings and lists of mappings (phases, rewards) are walked into
    (`phases.1.max_steps`); other lists are values (`peft.target_modules`)."""
    if isinstance(raw, dict):
        items = raw.items()
    elif isinstance(raw, list) and raw and all(isinstance(item, dict) for item in raw):
        items = enumerate(raw)
    else:
        return {prefix: raw}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def alters_training(key: str, recipe: dict[str, Any] | None = None) -> bool:
    """Whether changing `key` (flattened) can change the trained weights (see `LOGGING_ONLY`)."""
    plateau = str(((recipe or {}).get("training") or {}).get("plateau_metric") or "eval_")
    if key in _LOGGING_FREQUENCY and not plateau.startswith("eval_"):
        return True
    return not any(fnmatch.fnmatchcase(key, pattern) for pattern in LOGGING_ONLY)


def _defaults(cls: type) -> dict[str, Any]:
    """A schema dataclass's field defaults (fields without one left out)."""
    defaults = {}
    for spec in dataclasses.fields(cls):
        if spec.default is not dataclasses.MISSING:
            defaults[spec.name] = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            defaults[spec.name] = spec.default_factory()
    return defaults


def _same_set(value: Any) -> Any:
    """A module list PEFT reads as a set (`LoraConfig.target_modules`), in one order; other values as they are."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return sorted(set(value))
    return value


def canonical(raw: Any) -> Any:
    """A recipe with every spelling of one setting made one: the schema sections' and rewards' defaults written out
    (`weight: 1.0` is the weight an entry without one has), `model: NAME` as `model: {name_or_path: NAME}`, a reward
    given by name as `{name: NAME}`, and LoRA target module lists sorted (PEFT keeps them as a set). `training` and
    `phases` keys are compared as written: their effective values are resolved later, from other keys."""
    if not isinstance(raw, dict):
        return raw
    raw = dict(raw)
    if isinstance(raw.get("model"), str):
        raw["model"] = {"name_or_path": raw["model"]}
    for name, cls in SECTIONS.items():
        if isinstance(raw.get(name), dict):
            raw[name] = {**_defaults(cls), **raw[name]}
    if isinstance(raw.get("peft"), dict):
        raw["peft"]["target_modules"] = _same_set(raw["peft"].get("target_modules"))
    if isinstance(raw.get("rewards"), list):
        entries = [{"name": entry} if isinstance(entry, str) else entry for entry in raw["rewards"]]
        raw["rewards"] = [{**_defaults(RewardSpec), **entry} if isinstance(entry, dict) else entry for entry in entries]
    if isinstance(raw.get("phases"), list):
        raw["phases"] = [
            {**phase, "lora_target_modules": _same_set(phase["lora_target_modules"])}
            if isinstance(phase, dict) and "lora_target_modules" in phase
            else phase
            for phase in raw["phases"]
        ]
    return raw


def recipe_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    """Every key whose value differs between the recorded recipe and the current one (both as `Recipe.raw`; values
    spelled differently but equal in effect, `canonical`, are not changes)."""
    return _changes(flatten(canonical(recorded)), current)


def _changes(old: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    new = flatten(canonical(current))
    return [
        Change(key, old.get(key, _UNSET), new.get(key, _UNSET), alters_training(key, current))
        for key in sorted(old.keys() | new.keys())
        if old.get(key, _UNSET) != new.get(key, _UNSET)
    ]


def _read_run_yaml(path: Path, kind: type, what: str) -> Any:
    """A YAML file the run wrote, parsed as `kind` (an empty file: an empty one); a file that is not valid YAML, is
    not text or holds another type is refused with `ChangedRecipeError` (exit 2) naming it, never a traceback."""
    from ..files import UnreadableFileError, read_yaml

    try:
        return read_yaml(path, kind)
    except UnreadableFileError as error:
        raise ChangedRecipeError(_unreadable(path, what, error.problem)) from None


def _unreadable(path: Path, what: str, problem: str) -> str:
    return (
        f"--resume: {path} ({what}) is damaged: {problem}. Nothing was loaded or changed. Restore the file (from a "
        "backup or a copy of the run), or start a new run; a resume cannot tell what the run was trained with without it."
    )


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / RESUME_HISTORY_NAME
    if not path.is_file():
        return []
    history = _read_run_yaml(path, list, "the changes earlier resumes went on with")
    if not all(isinstance(entry, dict) and isinstance(entry.get("changes") or [], list) for entry in history):
        raise ChangedRecipeError(_unreadable(path, "the changes earlier resumes went on with", "an entry is malformed"))
    return history


def live_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The resume-history entries on the run's current path: a resume from global step N abandons what came after N
    (its checkpoints are un-committed, `supersede_after`), so an earlier entry recorded at a later step than N no
    longer describes the run. An entry without a step (a plain TRL checkpoint) counts as step 0."""
    live: list[dict[str, Any]] = []
    for entry in history:
        step = _entry_step(entry)
        live = [kept for kept in live if _entry_step(kept) <= step] + [entry]
    return live


def _entry_step(entry: dict[str, Any]) -> int:
    step = entry.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else 0


def checkpoint_global_step(state: dict[str, Any]) -> int | None:
    """The run's global step at a checkpoint (`state`: its `prorl_state.json`); None when unknown (`{}`)."""
    if isinstance(state.get("global_step"), int):
        return state["global_step"]
    if isinstance(state.get("phase_global_step"), int):
        return int(state.get("global_step_offset") or 0) + state["phase_global_step"]
    return None


def recorded_recipe(run_dir: Path, global_step: int | None = None) -> dict[str, Any] | None:
    """The run's recipe as its resumes left it (flattened; None when the run recorded no recipe): `recipe.yaml` with
    the changes of the resume history on the run's current path (`live_history`) applied, and with `global_step`
    (a checkpoint's) only those recorded up to that step: a checkpoint trained with the recipe as it was then, and
    a change recorded at a later step took effect after it."""
    path = run_dir / RECORDED_RECIPE_NAME
    if not path.is_file():
        return None
    flat = flatten(canonical(_read_run_yaml(path, dict, "the recipe the run was started with")))
    for entry in live_history(read_history(run_dir)):
        if global_step is not None and _entry_step(entry) > global_step:
            continue
        for change in entry.get("changes") or []:
            key = str(change.get("key", ""))
            # how it ran (`world_size_change`) and what a data file held (`data_files.json`): not recipe keys
            if key.startswith("launch.") or key.startswith(f"{DATA_FILE_KEY} ("):
                continue
            if "new" in change:
                flat[key] = change["new"]
            else:
                flat.pop(key, None)
    return flat


def changes_since_recorded(
    run_dir: Path, current: dict[str, Any], global_step: int | None = None
) -> list[Change] | None:
    """The changes of `current` (a `Recipe.raw`) against the run's recorded recipe (as recorded up to a checkpoint's
    `global_step`, `recorded_recipe`); None when there is none."""
    flat = recorded_recipe(run_dir, global_step)
    return None if flat is None else _changes(flat, current)


class ChangedRecipeError(RecipeError):
    """`--resume` with a recipe that alters training, without `--allow-changes` (exit 2, nothing loaded)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__("command line", [])

    def render(self) -> str:
        return self.message


def data_file_changes(
    run_dir: Path, data_now: dict[str, dict[str, str]], global_step: int | None = None
) -> list[Change]:
    """A change per split whose local data file holds other bytes than the run recorded up to the checkpoint's
    `global_step` (`recorded_data_files`), or whose recorded file is gone from the recipe; none for a run that
    recorded no data files."""
    recorded = recorded_data_files(run_dir, global_step)
    if recorded is None:
        return []
    changes = []
    for split in sorted(recorded.keys() | data_now.keys()):
        old, new = recorded.get(split, {}), data_now.get(split, {})
        if old.get("fingerprint") != new.get("fingerprint"):
            where = new.get("file") or old.get("file")
            changes.append(Change(f"{DATA_FILE_KEY} ({split}) {where}", old.get("fingerprint", _UNSET),
                                  new.get("fingerprint", _UNSET), alters_training=True))  # fmt: skip
    return changes


def recorded_data_files(run_dir: Path, global_step: int | None = None) -> dict[str, dict[str, Any]] | None:
    """What the run's local data files held (`{split: {"file", "fingerprint"}}`) as recorded up to a checkpoint's
    `global_step`, the way `recorded_recipe` reads the recipe; None when the run recorded none. `data_files.json` is
    rewritten by a resume that accepts new bytes, so it is the latest record, not the start's: a split a resume
    changed held at the start what its first recorded change calls `old`. The data-file changes of the live history
    up to the step are applied on top: a checkpoint trained on the bytes of its own path, not the latest ones."""
    path = run_dir / DATA_FILES_NAME
    if not path.is_file():
        return None
    held, history = _read_data_files(path), read_history(run_dir)
    started: dict[str, tuple[str, Any]] = {}
    for entry in history:
        for split, file, change in _data_changes_of(entry):
            started.setdefault(split, (file, change.get("old", _UNSET)))
    for split, (file, fingerprint) in started.items():
        _hold(held, split, file, fingerprint)
    for entry in live_history(history):
        if global_step is None or _entry_step(entry) <= global_step:
            for split, file, change in _data_changes_of(entry):
                _hold(held, split, file, change.get("new", _UNSET))
    return held


def _read_data_files(path: Path) -> dict[str, dict[str, Any]]:
    """`data_files.json`, refused (exit 2, naming it) when it is not the mapping of splits the run wrote."""
    from ..files import UnreadableFileError, read_json

    try:
        recorded = read_json(path, dict)
    except UnreadableFileError as error:
        raise ChangedRecipeError(_unreadable(path, "what the run's data files held", error.problem)) from None
    if not all(isinstance(v, dict) for v in recorded.values()):
        raise ChangedRecipeError(_unreadable(path, "what the run's data files held", "it is not a mapping of splits"))
    return recorded


def _data_changes_of(entry: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(split, file, change record) of each data-file change a resume-history entry recorded (`data_file_changes`
    names them `data file (<split>) <file>`)."""
    found = []
    for change in entry.get("changes") or []:
        match = re.fullmatch(rf"{DATA_FILE_KEY} \((\w+)\) (.*)", str(change.get("key", "")), re.S)
        if match:
            found.append((match[1], match[2], change))
    return found


def _hold(held: dict[str, dict[str, Any]], split: str, file: str, fingerprint: Any) -> None:
    """Record that `split` held `fingerprint` (`_UNSET`: the recipe had no such local file)."""
    if fingerprint is _UNSET:
        held.pop(split, None)
    else:
        held[split] = {"file": file, "fingerprint": fingerprint}


def same_base_model_folder(change: Change, state: dict[str, Any]) -> bool:
    """Whether a `model.name_or_path` change names a local folder holding the very weights the checkpoint's deltas
    sit on (`state`: its `prorl_state.json`; the model folder moved or copied): the same model, so not a change. The
    trainer compares the same fingerprint again when it loads (`base_model_difference`)."""
    if change.key != "model.name_or_path" or not isinstance(change.new, str):
        return False
    from ..reset.provenance import folder_fingerprint

    folder = Path(change.new).expanduser()
    recorded = (state.get("base_model") or {}).get("fingerprint") if isinstance(state.get("base_model"), dict) else None
    return bool(recorded) and folder.is_dir() and recorded == folder_fingerprint(folder)


def phase_of_key(key: str) -> int | None:
    """The phase index a flattened key sets (`phases.2.temperature` -> 2), None for a key outside `phases`."""
    import re

    match = re.match(r"phases\.(\d+)\.", key)
    return int(match[1]) if match else None


def recorded_changes(run_dir: Path, current: dict[str, Any], state: dict[str, Any]) -> list[Change] | None:
    """`changes_since_recorded` as recorded up to the checkpoint's global step (`state`: its `prorl_state.json`, or
    `{}`), less a model path naming the very weights the checkpoint sits on (`same_base_model_folder`); None when the
    run recorded no recipe."""
    recorded = changes_since_recorded(run_dir, current, checkpoint_global_step(state))
    if recorded is None or not state:
        return recorded
    return [change for change in recorded if not same_base_model_folder(change, state)]


def _phase_stays_complete(changes: list[Change], state: dict[str, Any]) -> bool:
    """Whether no step of the checkpoint's own phase is left to train after this resume: it ended (its last step, a
    plateau stop, a reset on demand) and no longer `phases.<i>.max_steps` takes it on (only a phase that ran to its
    length can), or this resume's `phases.<i>.max_steps` ends it at the checkpoint's step (or before it: refused as
    shorter than trained, `trainer.state.resumed_phase_complete`)."""
    reason = state.get("phase_end_reason", "max_steps")
    if state.get("phase_complete") and reason != "max_steps":
        return True
    length = next((change.new for change in changes if change.key == _own_length_key(state)), None)
    if isinstance(length, int) and not isinstance(length, bool):
        return length <= state.get("phase_global_step", 0)
    return bool(state.get("phase_complete"))


def _own_length_key(state: dict[str, Any]) -> str:
    return f"phases.{state['phase_index']}.max_steps"


def _length_applies(state: dict[str, Any]) -> bool:
    """Whether a new `max_steps` of the checkpoint's own phase can take effect: only where the phase ends at its
    length; one ended otherwise (a plateau stop, a reset on demand) stays ended (`resumed_phase_complete`)."""
    return state.get("phase_end_reason", "max_steps") == "max_steps"


def _jumps(state: dict[str, Any]) -> list[tuple[int, int, Any]]:
    """(from phase, to phase, global step) of each reset on demand the checkpoint recorded (`on_demand_resets`):
    the trainer skips the phases between (`trainer.on_demand.next_phase_after`)."""
    records = state.get("on_demand_resets") or []
    return [
        (record["from_phase"], record["to_phase"], record.get("step")) for record in records
        if isinstance(record, dict) and all(_is_index(record.get(key)) for key in ("from_phase", "to_phase"))
    ]  # fmt: skip


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resumed_into(changes: list[Change], state: dict[str, Any]) -> int:
    """The first phase a resume from the checkpoint (`state`: its `prorl_state.json`) can still train: its own, the
    next when no step of its own is left (`_phase_stays_complete`), or the phase a recorded reset on demand jumped to
    (the phases before it are skipped)."""
    own = state["phase_index"] + (1 if _phase_stays_complete(changes, state) else 0)
    return max([own] + [to for _, to, _ in _jumps(state)])


def refuse_finished_phase_changes(changes: list[Change], state: dict[str, Any], checkpoint: Path) -> None:
    """A change to a phase with no step left to train after the resume from the checkpoint (`state`: its
    `prorl_state.json`) cannot be honoured (`phases.<i>.*`, i below the phase it resumes into, `resumed_into`: phases
    that trained, its own when it is over or this resume ends it at the checkpoint's step, and phases a reset on
    demand skipped). Refused (exit 2) even with `--allow-changes`, rather than accepted and left without effect. The
    own phase's length change that ends it at the checkpoint is not one of them (ending a phase at the checkpoint's
    step is what a resume can do), unless the phase ended otherwise than at its length: then no length applies."""
    current = resumed_into(changes, state)
    own_length = _own_length_key(state) if _length_applies(state) else None
    finished = [
        change for change in changes
        if (phase := phase_of_key(change.key)) is not None and phase < current and change.key != own_length
    ]  # fmt: skip
    if not finished:
        return
    listed = "\n".join(f"  {change.describe()}" for change in finished)
    ended = _phase_stays_complete(changes, state)
    skipped = _skipped_note({phase_of_key(change.key) for change in finished}, state)
    raise ChangedRecipeError(
        f"--resume: {checkpoint} resumes into phase {current}"
        + (f" (phase {state['phase_index']} has no step left to train after it)" if ended else "")
        + (f"; {skipped[0]}" if skipped else "")
        + f", so these settings of {'earlier phases, finished or skipped,' if skipped else 'earlier, finished phases'}"
        f" cannot take effect:\n{listed}\nNothing was loaded or changed. Drop those overrides (keep those phases as "
        "recorded); a change to the current phase or a later one, or to `training`, is what a resume can apply (a "
        f"phase inherits what it leaves unset from the phase before it: to change a setting from phase {current} on, "
        f"set it there, `--phases.{current}.<key> VALUE`)." + (f" {skipped[1]}" if skipped else "")
    )


def _skipped_note(phases: set[int | None], state: dict[str, Any]) -> tuple[str, str] | None:
    """How a refusal names the refused phases a reset on demand skipped, and how to train them after all; None
    when none of them was skipped."""
    said, steps = [], []
    for start, to, step in _jumps(state):
        skipped = [str(phase) for phase in range(start + 1, to) if phase in phases]
        if skipped:
            many = len(skipped) > 1
            said.append(f"phase{'s' if many else ''} {', '.join(skipped)} never train{'' if many else 's'}: the reset "
                        f"on demand at global step {step} (`prorl-trl reset --to-phase {to}`) ended phase {start} and "
                        f"skipped {'them' if many else 'it'}")  # fmt: skip
            steps += [step] if _is_index(step) else []
    if not said:
        return None
    before = f"before global step {min(steps)}" if steps else "before that reset"
    return "; ".join(said), (
        f"To train a skipped phase with these settings after all, resume from a checkpoint written {before} "
        "(`--resume RUN_DIR/phase-<i>/checkpoint-<step>`): from there that phase is still ahead."
    )


def phase_names(flat: dict[str, Any]) -> list[str]:
    """The phase names of a flattened recipe (`phase-<i>` where unnamed; one phase when it sets no `phases`)."""
    indexes = {phase_of_key(key) for key in flat} - {None}
    count = max(indexes) + 1 if indexes else 1
    return [str(flat.get(f"phases.{index}.name") or f"phase-{index}") for index in range(count)]


def refuse_waiting_request_conflicts(
    changes: list[Change], state: dict[str, Any], output_dir: Path, current: dict[str, Any],
    recorded: dict[str, Any] | None,
) -> None:  # fmt: skip
    """A reset on demand still waiting in `output_dir` (written while the job was down: in no checkpoint yet) acts
    at the resumed job's first step end: it ends the phase the resume goes into (`resumed_into`) and skips the ones
    before its target, as a recorded one did. A change to a phase it skips, or a new length of the phase it ends, is
    refused as `refuse_finished_phase_changes` refuses one for a recorded reset; so is a request that this resume's
    change (`current`, against the `recorded` recipe, flattened) makes unfit. A request unfit anyway is left to the
    job, which files it as refused with a warning as for a running job: an unchanged resume is never blocked by it."""
    from ..trainer.on_demand import request_target, waiting_request

    request = waiting_request(output_dir, state.get("on_demand_resets") or [])
    names, into = phase_names(flatten(canonical(current))), resumed_into(changes, state)
    if request is None or into >= len(names):  # none, or nothing left to train (a finished run)
        return
    try:
        target = request_target(request, into, names)
    except ValueError as problem:
        if recorded is not None and _fits(request, state, phase_names(recorded)):
            raise ChangedRecipeError(_unfit_message(output_dir, request, str(problem), into)) from None
        return
    ended, skipped = f"phases.{into}.max_steps", range(into + 1, target)
    void = [change for change in changes if change.key == ended or phase_of_key(change.key) in skipped]
    if void:
        step = checkpoint_global_step(state)
        raise ChangedRecipeError(_void_message(output_dir, request, void, into, target, step))


def _fits(request: dict[str, Any], state: dict[str, Any], names: list[str]) -> bool:
    """Whether the job would act on the request when resumed with the recipe as recorded (no change)."""
    from ..trainer.on_demand import request_target

    try:
        request_target(request, resumed_into([], state), names)
    except ValueError:
        return False
    return True


def _withdraw(output_dir: Path) -> str:
    from ..trainer.on_demand import request_path

    path = request_path(output_dir)
    return f"delete {path} (`prorl-trl reset` has no option to withdraw a request; a new one replaces it)"


def _void_message(
    output_dir: Path, request: dict[str, Any], void: list[Change], into: int, target: int, step: int | None
) -> str:
    from ..trainer.on_demand import describe_request

    at = f"at global step {step + 1}" if step is not None else "after its first step"
    skipped = [str(phase) for phase in range(into + 1, target)]
    skips = f" and skips phase{'s' if len(skipped) > 1 else ''} {', '.join(skipped)}" if skipped else ""
    listed = "\n".join(f"  {change.describe()}" for change in void)
    return (
        f"--resume: a reset on demand is waiting in {describe_request(output_dir, request)}: the resumed job acts on "
        f"it at its first step end, so it ends phase {into} {at}{skips} before starting phase {target}, and these "
        f"settings cannot take effect:\n{listed}\nNothing was loaded or changed. Drop those overrides (a setting of "
        f"phase {target} or a later one, or of `training`, is what this resume can apply; a phase inherits what it "
        f"leaves unset from the phase before it: to change what phase {target} trains with, set it there, "
        f"`--phases.{target}.<key> VALUE`), or withdraw the request first: {_withdraw(output_dir)}; then resume with "
        f"these settings, and ask the running job again (`prorl-trl reset {output_dir} [--to-phase N]`) when you want."
    )


def _unfit_message(output_dir: Path, request: dict[str, Any], problem: str, into: int) -> str:
    from ..trainer.on_demand import RECORDS_FOLDER, describe_request

    return (
        f"--resume: a reset on demand is waiting in {describe_request(output_dir, request)}, and with this resume's "
        f"changes {problem} (the run resumes into phase {into}). It fits the recipe as recorded: the job would refuse "
        f"it at its first step end ({RECORDS_FOLDER}/refused-step-<N>.json, a warning) and train on in phase {into} "
        f"instead of ending it. Nothing was loaded or changed. Resume without the change that makes it unfit, or "
        f"withdraw the request first: {_withdraw(output_dir)}; once the job runs, `prorl-trl reset {output_dir} "
        "[--to-phase N]` asks it again."
    )


def world_size_change(state: dict[str, Any], world_size: int | None) -> Change | None:
    """The number of processes against the one the checkpoint (`state`: its `prorl_state.json`) was written by: it
    sets the completions per optimizer step (per device x processes x accumulation), so a resume on another number
    changes training. None when either is unknown (checkpoints before 2026-11-29, `validate`) or they agree."""
    recorded = state.get("world_size")
    if world_size is None or not isinstance(recorded, int) or recorded == world_size:
        return None
    return Change("launch.world_size", recorded, world_size, True)


def check_resume_changes(
    run_dir: Path, current: dict[str, Any], allow_changes: bool, data_now: dict[str, dict[str, str]] | None = None,
    checkpoint: Path | None = None, world_size: int | None = None, output_dir: Path | None = None,
) -> list[Change]:  # fmt: skip
    """The changes a resume into `run_dir` makes (recipe keys, and the content of local data files when `data_now`,
    `split_fingerprints` of the current recipe, is given); raises `ChangedRecipeError` for training-altering ones
    unless `allow_changes`. Returns every change (an empty list when nothing differs). With the `checkpoint` resumed
    from, a model path that names the same weights in another place is not a change (`same_base_model_folder`); with
    the `output_dir` the job will write to, a reset on demand waiting there is checked against the changes."""
    from ..reset.checkpoint import PRORL_STATE_NAME, read_prorl_state

    # the checkpoint's record, read once (exit 2 when damaged); none for a plain TRL checkpoint (one phase)
    state = read_prorl_state(checkpoint) if checkpoint is not None and (checkpoint / PRORL_STATE_NAME).is_file() else {}
    recorded = recorded_changes(run_dir, current, state)
    if recorded is None and RECORDED_RECIPE_NAME in (read_manifest(run_dir) or []) and not allow_changes:
        raise ChangedRecipeError(
            f"--resume: {run_dir / RECORDED_RECIPE_NAME} is missing, so this resume cannot tell whether the recipe "
            "changes training (the run wrote that file when it started). Nothing was loaded or changed. Restore it, "
            "or pass --allow-changes to continue with this recipe as given (it is then recorded as the run's recipe)."
        )
    step = checkpoint_global_step(state)
    changes = (recorded or []) + (data_file_changes(run_dir, data_now, step) if data_now is not None else [])
    launched = world_size_change(state, world_size)
    changes += [launched] if launched is not None else []
    altering = [change for change in changes if change.alters_training]
    if state:
        refuse_finished_phase_changes(altering, state, checkpoint)
    if state and output_dir is not None:
        refuse_waiting_request_conflicts(altering, state, output_dir, current, recorded_recipe(run_dir, step))
    if altering and not allow_changes:
        listed = "\n".join(f"  {change.describe()}" for change in altering)
        raise ChangedRecipeError(
            f"--resume: the recipe differs from the one {run_dir}/ was trained with ({RECORDED_RECIPE_NAME}"
            f"{_history_part(run_dir, step)}) in settings that "
            f"change training:\n{listed}\nNothing was loaded or changed. Resume with the run's settings (drop those "
            "overrides, or pass the old values), or pass --allow-changes to continue with the new ones (they are "
            f"recorded in {RESUME_HISTORY_NAME}; {RECORDED_RECIPE_NAME} keeps the original)."
        )
    return changes


def _history_part(run_dir: Path, global_step: int | None) -> str:
    """How a refusal names the changes an earlier resume recorded (those the checkpoint is compared with)."""
    if not read_history(run_dir):
        return ""
    upto = f" up to global step {global_step}" if global_step else ""
    return f" and the changes in {RESUME_HISTORY_NAME}{upto}"


def record_resume(
    run_dir: Path, changes: list[Change], checkpoint: str | None, global_step: int | None, argv: list[str] | None = None,
    extended: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Append one resume that went on with `changes` to `<run_dir>/resume_history.yaml` (atomically rewritten);
    `extended`: what the resume added to a finished run (`recipe.extend.Extension.record`)."""
    from ..reset.checkpoint import write_text_atomically

    entry = {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "checkpoint": checkpoint,
        "global_step": global_step,
        "command": shlex.join(sys.argv if argv is None else argv),
        **({"extended": extended} if extended else {}),
        "changes": [change.to_record() for change in changes],
    }
    history = read_history(run_dir) + [entry]
    write_text_atomically(run_dir / RESUME_HISTORY_NAME, yaml.safe_dump(history, sort_keys=False, allow_unicode=True))


def _recorded_in(output_dir: Path, checkpoint: Path) -> Path:
    """The folder whose recipe a resume is compared with: the output folder's, else the checkpoint's run folder's
    (a checkpoint of another run continued into a new folder)."""
    from ..reset.checkpoint import in_phase_dir

    if (output_dir / RECORDED_RECIPE_NAME).is_file() or not in_phase_dir(checkpoint):
        return output_dir
    return checkpoint.resolve().parent.parent


def resume_changes(
    checkpoint: str | None, output_dir: str | Path, current: dict[str, Any], allow_changes: bool,
    data_now: dict[str, dict[str, str]] | None = None, world_size: int | None = None,
) -> list[Change]:  # fmt: skip
    """`train`/`validate`: the changes a resume from `checkpoint` (None: a start, nothing to compare) makes to the
    run's recorded recipe and data files (and, from `train`, to its number of processes); raises
    `ChangedRecipeError` (exit 2) for training-altering ones without `allow_changes`."""
    if checkpoint is None:
        return []
    recorded_in = _recorded_in(Path(output_dir), Path(checkpoint))
    return check_resume_changes(
        recorded_in, current, allow_changes, data_now, checkpoint=Path(checkpoint), world_size=world_size,
        output_dir=Path(output_dir),
    )


def write_run_recipe(
    output_dir: Path, recipe_yaml: str, checkpoint: str | None, changes: list[Change],
    data_now: dict[str, dict[str, str]] | None = None, extended: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Main process, before training: a start writes `recipe.yaml` (and drops the history of an earlier attempt that
    left no checkpoint); a resume never rewrites it, and appends the changes it went on with (and `extended`, what it
    adds to a finished run) to the history, also with no change when it abandons steps an earlier resume recorded
    changes at (`live_history`). `data_files.json` holds what the local data files held at the start, or at the last
    resume that accepted a change to them; a resume compares with the record in effect at its checkpoint's step
    (`recorded_data_files`: the start's, with the data-file changes of the history up to that step)."""
    from ..reset.checkpoint import write_json

    data_changed = any(change.key.startswith(f"{DATA_FILE_KEY} (") for change in changes)
    if data_now is not None and (checkpoint is None or data_changed or not (output_dir / DATA_FILES_NAME).is_file()):
        write_json(output_dir / DATA_FILES_NAME, data_now)
    from ..reset.checkpoint import (
        PRORL_STATE_NAME,
        read_prorl_state,
        write_text_atomically,
    )

    recorded = output_dir / RECORDED_RECIPE_NAME
    if checkpoint is None or not recorded.is_file():
        write_text_atomically(recorded, recipe_yaml)
        if checkpoint is None:
            (output_dir / RESUME_HISTORY_NAME).unlink(missing_ok=True)
        return
    committed = Path(checkpoint, PRORL_STATE_NAME).is_file()  # a plain TRL checkpoint has none
    step = checkpoint_global_step(read_prorl_state(checkpoint)) if committed else None
    # A resume from before a step where an earlier resume recorded changes abandons them (`live_history`): recorded
    # with no change of its own, so that the checkpoints it writes are compared with the recipe they train with.
    abandons = step is not None and any(_entry_step(entry) > step for entry in live_history(read_history(output_dir)))
    if changes or extended or abandons:
        record_resume(output_dir, changes, checkpoint, step, extended=extended)
