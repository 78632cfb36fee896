"""`prorl-trl train`: a validated recipe -> tokenizer, datasets, rewards, callbacks -> `ProRLTrainer.train()`.

Everything that can be wrong with the recipe is caught first, in one list (`preflight.require_valid`, the checks of
`validate`; exit 2, nothing written), and a folder that already holds a run is refused unless `--resume`/`--overwrite`
say what to do with it (`output_folder`). Only then is anything loaded; the output folder is written by the trainer, plus `recipe.yaml`
(the effective recipe, after overrides) and `run_summary.json` (final metrics and the log history of the whole run,
read by `prorl-trl ablate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..console import loading_models
from ..data.fingerprint import split_fingerprints
from ..trainer.manifest import CLI_FILES, record_outputs
from ..trainer.output_guard import describe_checkpoint
from .changes import RESUME_HISTORY_NAME, resume_changes, write_run_recipe
from .extend import extended_plan
from .output_folder import (
    delete_run_outputs,
    free_bytes,
    inspect_output_folder,
    is_disk_full,
    plan_start,
    resume_command,
    run_writes,
)
from .preflight import require_readable_golds, require_valid, reward_functions_for
from .recipe import Recipe
from .schema import RecipeError, RecipeProblem

if TYPE_CHECKING:  # pragma: no cover
    from ..trainer.interrupt import SignalStop


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def describe_recipe(recipe: Recipe, world_size: int = 1) -> str:
    """A short human summary: model, data, rewards and the resolved phase table (read it against the paper's)."""
    from ..config import resolve_phases

    data = recipe.data
    lora = "full fine-tuning" if recipe.peft is None or not recipe.peft.enabled else f"LoRA r={recipe.peft.r}"
    lines = [
        f"recipe:  {recipe.file}" + (f" - {recipe.description.strip().splitlines()[0]}" if recipe.description else ""),
        f"model:   {recipe.model.name_or_path} ({recipe.model.dtype}, {lora})",
        f"data:    {data.builder} {data.source or '(default source)'} [{data.split or 'default split'}]"
        + (
            f", validation [{data.validation_split}] x{data.validation_size or 'all'}" if data.validation_split else ""
        ),
        "rewards: " + ", ".join(f"{spec.name} x{spec.weight:g}" for spec in recipe.rewards),
    ]
    phases = recipe.resolved_phases or resolve_phases(recipe.training_args(dry=True, world_size=world_size), recipe.peft_config(), world_size)
    lines.append(
        f"{'phase':<16}{'steps':>6}{'T':>6}{'top_p':>6}{'n':>4}{'max_len':>8}{'buffer':>7}{'lora_r':>7}{'reset':>6}"
    )
    for phase in phases:
        lines.append(
            f"{phase.name[:15]:<16}{phase.length:>6}{phase.temperature:>6g}{phase.top_p:>6g}{phase.num_generations:>4}"
            f"{phase.max_completion_length:>8}{phase.overlong_buffer:>7}{str(phase.lora_r or '-'):>7}"
            f"{'yes' if phase.hard_reset else '-':>6}"
        )
    return "\n".join(lines)


def _models_loaded(name_or_path: str, beta: float, peft: bool) -> str:
    """What TRL's GRPOTrainer loads: the policy, and for full fine-tuning with a KL term a second copy of the same
    weights as the frozen reference (with LoRA the reference is the base with the adapter disabled)."""
    if beta != 0.0 and not peft:
        return f"{name_or_path}: policy + reference (a second copy; beta={beta:g}, full fine-tuning)"
    return f"{name_or_path}: policy"


def check_lora_targets(recipe: Recipe) -> None:
    """Every phase's LoRA target modules exist in the model: PEFT's own matching, on a copy of the model built on the
    meta device from its config (no weights read). Raises `RecipeError` (exit 2) naming the phase, before anything in
    the run folder is deleted or written."""
    base = recipe.peft_config()
    if base is None:
        return
    import copy

    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model = recipe.model
    config = AutoConfig.from_pretrained(
        model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code
    )
    problems, checked = [], set()
    for phase in getattr(recipe, "resolved_phases", None) or []:
        targets = phase.lora_target_modules
        key = targets if isinstance(targets, str) else tuple(sorted(targets or ()))
        if key in checked or targets is None:
            continue
        checked.add(key)
        lora = copy.deepcopy(base)
        lora.target_modules = targets if isinstance(targets, str) else set(targets)
        with torch.device("meta"):
            bare = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
        try:
            get_peft_model(bare, lora)
        except ValueError as error:  # PEFT: "Target modules {...} not found in the base model ..."
            path = f"phases.{phase.index}.lora_target_modules" if recipe.phases else "peft.target_modules"
            problems.append(RecipeProblem(path, str(error).split("\n")[0], targets))
    if problems:
        raise RecipeError(recipe.file, problems)


def _validation_callback(recipe: Recipe, eval_dataset: Any, args: Any) -> Any:
    if recipe.validation is None or not recipe.validation.enabled or eval_dataset is None:
        return None
    from ..evaluation.validation import ValidationCallback

    settings = recipe.validation
    # `validation.reward` was checked to name one of the recipe's rewards: grade with its params.
    spec = next(s for s in recipe.rewards if s.name == (settings.reward or recipe.rewards[0].name))
    import rewards

    reward = rewards.get_reward(spec.name, **spec.params)
    return ValidationCallback(
        dataset=eval_dataset,
        reward_func=reward,
        eval_steps=settings.eval_steps,
        num_problems=recipe.data.validation_size,
        num_generations=settings.num_samples,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_completion_length=settings.max_completion_length,
        ks=settings.ks,
        batch_size=settings.batch_size,
        at_start=settings.at_start,
        seed=args.seed,
    )


def summarize_log(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """Final validation metrics (last logged `eval_*`), per-reward means over all logged training steps, and how many
    non-finite steps were skipped (`max_nonfinite_skips`)."""
    final_eval: dict[str, float] = {}
    reward_values: dict[str, list[float]] = {}
    steps = skips = 0
    for entry in log_history:
        steps = max(steps, int(entry.get("prorl/global_step", entry.get("step", 0)) or 0))
        skips = max(skips, int(entry.get("prorl/nonfinite_skips", 0) or 0))
        for key, value in entry.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                continue
            if key.startswith("eval_"):
                final_eval[key] = float(value)
            elif key.startswith("rewards/") and key.endswith("/mean"):
                reward_values.setdefault(key[len("rewards/") : -len("/mean")], []).append(float(value))
    reward_means = {name: sum(values) / len(values) for name, values in reward_values.items()}
    return {"steps": steps, "final_eval": final_eval, "reward_means": reward_means, "nonfinite_skips": skips}


def write_final_card(final: Path, recipe: Recipe, base_model: str, summary: dict[str, Any]) -> None:
    """`final/README.md`: the base model, the recipe and its phase table, rewards, data and final validation."""
    from ..model_card import phase_table, write_model_card

    resets = sum(phase.hard_reset for phase in recipe.resolved_phases or [])
    data = recipe.data
    details = ["## Phases", "", *phase_table(recipe.resolved_phases or []), "", "## Recipe", ""]
    details += [
        f"- recipe: `{recipe.file}` (with its overrides: `../recipe.yaml`)",
        f"- data: `{data.builder}` {data.source or '(default source)'}, template {data.template or 'default'}",
        "- rewards: " + ", ".join(f"`{spec.name}` x{spec.weight:g}" for spec in recipe.rewards),
        "- adapter: " + ("full fine-tuning" if recipe.peft is None or not recipe.peft.enabled
                         else f"LoRA r={recipe.peft.r}, merged into the weights"),  # fmt: skip
    ]
    if recipe.distill is not None:
        details.append(f"- distilled from `{recipe.distill.get('teacher')}` before the phases (`../distill/`)")
    if summary["final_eval"]:
        details += ["", "## Final validation", ""] + [f"- {k}: {v:.4g}" for k, v in sorted(summary["final_eval"].items())]
    write_model_card(
        final,
        base_model,
        f"Trained with prorl-trl (ProRL: prolonged GRPO in {len(recipe.resolved_phases or [])} phases with "
        f"{resets} hard reset(s), {summary['steps']} steps) from the recipe `{Path(recipe.file).name}`.",
        details,
    )


def run_train(
    recipe_path: str,
    overrides: list[str],
    resume: str | bool | None = None,
    overwrite: bool = False,
    allow_changes: bool = False,
    allow_other_files: bool = False,
) -> int:
    """Validate, check the output folder, load, train all phases, write the summary. Returns the exit status.

    `resume` (`--resume`; `training.resume_from_checkpoint` in the recipe means the same): True for the latest
    complete checkpoint, or a checkpoint path; `overwrite` (`--overwrite`) deletes the folder's run outputs first.
    A folder that holds a run needs one of the two (exit 2 before anything is loaded). A resume whose recipe changes
    training against the run's recorded one is refused the same way unless `allow_changes` (`--allow-changes`;
    `recipe.changes`). SIGINT/SIGTERM finish the
    step, write a checkpoint and print the command that resumes (exit 130/143); a full disk ends with one message.
    The signal handlers are in place from the start: a signal during start-up (loading, ~20 s) stops before the
    first step, with nothing trained, and says how to start again (exit 130/143).
    """
    from ..trainer.interrupt import StartupInterrupted, stop_on_signals

    with stop_on_signals() as signals:
        try:
            return _train(recipe_path, overrides, resume, overwrite, signals, allow_changes, allow_other_files)
        except StartupInterrupted as stop:
            if _is_main_process():
                flags = {"allow_changes": allow_changes, "allow_other_files": allow_other_files}
                print(_startup_stop_message(stop.reason, resume, overwrite, **flags), flush=True)
            return 130 if stop.reason == "SIGINT" else 143


def _startup_stop_message(
    reason: str, resume: str | bool | None, overwrite: bool, allow_changes: bool = False,
    allow_other_files: bool = False,
) -> str:  # fmt: skip
    """What a signal during start-up did (nothing trained) and the command that starts the run again as asked."""
    from ..trainer.interrupt import parent_command_line

    command = shlex.split(resume_command(parent_command_line()))[:-1]  # as launched, without the added --resume
    if overwrite:
        command.append("--overwrite")
    elif resume is True:
        command.append("--resume")
    elif resume:
        command += ["--resume", str(resume)]
    if allow_changes:  # nothing was recorded yet: the changes still need confirming
        command.append("--allow-changes")
    if allow_other_files:
        command.append("--allow-other-files")
    return (
        f"\nstopped by {reason} during start-up, before the first training step: nothing was trained and no "
        f"checkpoint was written.\nstart it again with:\n  {shlex.join(command)}"
    )


def _train(
    recipe_path: str, overrides: list[str], resume: str | bool | None, overwrite: bool, signals: SignalStop,
    allow_changes: bool = False, allow_other_files: bool = False,
) -> int:  # fmt: skip
    """`run_train`'s work, with `signals` stopping the start-up until the trainer is built and attached to them."""
    started = time.time()
    recipe = require_valid(recipe_path, overrides, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    base_model = recipe.model.name_or_path  # before a `distill:` section swaps in its student
    main = _is_main_process()
    if resume is None:
        resume = recipe.training.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume.lower() in ("true", "latest"):  # an override read as text
        resume = True
    plan = plan_start(  # every process, before any writes
        recipe.output_dir, resume, overwrite, allow_other_files=allow_other_files, writes=run_writes(recipe)
    )
    data_now = split_fingerprints(recipe.data)  # what the local data files hold now (a resume compares)
    # A finished run resumed with more steps or phases goes on from its last checkpoint (exit 2 for what cannot).
    plan, extension = extended_plan(plan, recipe, allow_changes, data_now)
    if plan.finished:
        if main:
            completed = _complete_finished_run(recipe, recipe_path, overrides, base_model, Path(recipe.output_dir))
            if completed:  # stopped between final/'s rename and the files written after it
                print(f"{plan.state.describe()}: wrote its missing {' and '.join(completed)}; nothing else changed.")
            else:
                print(f"{plan.state.describe()}: nothing to do; nothing was changed.")
        leave_process_group()  # every process read the same finished folder
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    changes = resume_changes(plan.resume, recipe.output_dir, recipe.raw, allow_changes, data_now, world_size)  # exit 2
    if plan.resume:  # a phase made shorter than the steps it trained: exit 2, nothing written
        from ..trainer.state import check_resumed_phase_length

        check_resumed_phase_length(plan.resume, recipe.training_args(), recipe.peft_config())
    if main and changes:
        print(f"note: resuming with changes to the recorded recipe (kept in {RESUME_HISTORY_NAME}):", flush=True)
        print("\n".join(f"  {change.describe()}" for change in changes), flush=True)
    if main:
        print(describe_recipe(recipe, world_size=int(os.environ.get("WORLD_SIZE", "1"))), flush=True)
    args = recipe.training_args()
    args.resume_from_checkpoint = None  # decided above; the trainer gets it explicitly
    from accelerate import PartialState

    PartialState().wait_for_everyone()  # every process has read the folder's state before the first write
    output_dir = Path(args.output_dir)
    # The data is built and checked before anything in the folder is deleted or written: a refused data file leaves
    # an earlier run (and an empty folder) as they were.
    tokenizer = recipe.load_tokenizer()
    from ..data import build_dataset

    with PartialState().main_process_first():  # rank 0 fills the datasets cache, the others read it
        train_dataset = build_dataset(recipe.data, "train", tokenizer, reward_functions_for(recipe, "train"))
        eval_dataset = build_dataset(recipe.data, "validation", tokenizer, reward_functions_for(recipe, "validation"))
    require_readable_golds(recipe, train_dataset, eval_dataset)
    check_lora_targets(recipe)  # before `--overwrite` deletes anything: a typo there would surface at model load
    reward_funcs = recipe.reward_functions()
    if main and plan.overwrite:
        with signals.deferred():  # a signal stops after the deletion, never halfway through it
            deleted, kept = delete_run_outputs(plan.state)
            print(f"--overwrite: deleted {', '.join(deleted) or 'nothing'} in {output_dir}/", flush=True)
            if kept:
                print(f"--overwrite: kept {', '.join(kept)} (reached through a symlink out of the run folder)")
    if main:  # what the CLI itself will create, before creating it (ProRLTrainer.train records its own outputs)
        extra = ["distill/"] if recipe.distill is not None else []
        record_outputs(output_dir, [*CLI_FILES, *extra])
    if main and plan.note:
        print(f"note: {plan.note}", flush=True)
    peft_config = recipe.peft_config()
    if recipe.distill is not None:  # distil a teacher into the model first; the phases start from the student
        from ..distill import run_distill_section

        student = run_distill_section(recipe.distill, recipe.model, Path(args.output_dir) / "distill", recipe.data)
        recipe.model = dataclasses.replace(recipe.model, name_or_path=str(student), tokenizer_name_or_path=None)
    if recipe.distill is not None:  # the student's own tokenizer (the same files, saved with it)
        tokenizer = recipe.load_tokenizer()
    callback = _validation_callback(recipe, eval_dataset, args)
    from ..trainer import ProRLTrainer
    from ..trainer.finite import NonFiniteUpdate
    from ..trainer.interrupt import RunInterrupted, parent_command_line

    extra = {"quantization_config": recipe.quantization_config()} if recipe.model.quantization else {}
    with loading_models(_models_loaded(recipe.model.name_or_path, args.beta, peft_config is not None), show=main):
        trainer = ProRLTrainer(
            model=recipe.model.name_or_path,
            processing_class=tokenizer,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            peft_config=peft_config,
            callbacks=[callback] if callback is not None else [],
            **extra,
        )
    signals.attach(trainer)  # a signal that came during start-up stops here; from now on, after the current step
    command = resume_command(parent_command_line())

    def record_run() -> None:
        """After the trainer's own resume checks (base model, frozen factors, adapter shape): a resume it refuses
        leaves recipe.yaml, resume_history.yaml and a finished run's final/ as they were."""
        if main:
            output_dir.mkdir(parents=True, exist_ok=True)
            if extension is not None:  # the finished run's final/ is kept; the extended run writes a new one
                extension.keep_previous_final()
            extended = extension.record() if extension is not None else None
            write_run_recipe(output_dir, recipe.to_yaml(), plan.resume, changes, data_now, extended)  # keeps the original

    trainer.on_resume_accepted.append(record_run)
    try:
        trainer.train(resume_from_checkpoint=plan.resume)
    except RunInterrupted as stop:
        if main:  # under `prorl-trl launch` the resume command is its last line, once every process has stopped
            resume = "" if os.environ.get("PRORL_LAUNCH_ARGV") else f"\nresume with:\n  {command}"
            print(
                f"\nstopped by {stop.reason} at global step {stop.global_step}; checkpoint written: {stop.checkpoint}/"
                + resume,
                flush=True,
            )
        leave_process_group()  # every rank stopped at the same step (the stop is agreed across processes)
        return 130 if stop.reason == "SIGINT" else 143
    except NonFiniteUpdate as stop:
        if main:
            print(f"\n{stop}\nresume with:\n  {command}", file=sys.stderr, flush=True)
        leave_process_group()  # every rank stopped at the same step (the decision is reduced across processes)
        return 1
    except Exception as error:
        if not is_disk_full(error, output_dir):
            raise
        if main:
            print(_disk_full_message(output_dir, error, command), file=sys.stderr, flush=True)
        return 1
    if main:
        _report(trainer, recipe, recipe_path, overrides, base_model, output_dir, started)
    leave_process_group()
    return 0


def leave_process_group() -> None:
    """Wait for every process, then tear the process group down while the interpreter is still whole.

    A gloo rank that exits with its group alive can abort in interpreter finalization (SIGABRT, "terminate called
    without an active exception") while rank 0 is still writing the summary; the launcher then kills rank 0 and a
    finished run exits as failed. No-op without a process group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _write_run_files(
    log_history: list[dict[str, Any]], recipe: Recipe, recipe_path: str, overrides: list[str], base_model: str,
    output_dir: Path, seconds: float | None, safety: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`run_summary.json` (the summary, `safety`: what guarded the run and the resets on demand, and the whole log)
    and `final/README.md` (the final model's card, when `final/` holds a model); returns the summary."""
    from ..reset.checkpoint import write_text_atomically

    summary = summarize_log(log_history)
    summary.update(recipe=str(recipe_path), overrides=list(overrides), seconds=seconds, **(safety or {}))
    write_text_atomically(
        output_dir / "run_summary.json", json.dumps({**summary, "log_history": log_history}, indent=1, default=str)
    )
    final = output_dir / "final"
    if (final / "config.json").is_file():
        write_final_card(final, recipe, base_model, summary)
    return summary


def _complete_finished_run(
    recipe: Recipe, recipe_path: str, overrides: list[str], base_model: str, output_dir: Path
) -> list[str]:
    """A finished run stopped after `final/` was renamed into place but before the files written after it: write
    them from the run's saved log history (`prorl_log_history.json`, complete at that point). Returns what was
    written (nothing when the run is whole)."""
    from ..reset.checkpoint import LOG_HISTORY_NAME

    missing = [name for name in ("run_summary.json", "final/README.md") if not (output_dir / name).is_file()]
    history = output_dir / LOG_HISTORY_NAME
    if not missing or not history.is_file():
        return []
    from ..files import read_json

    fix = "It is the finished run's log history; its summary cannot be written without it. Nothing was changed."
    _write_run_files(read_json(history, list, fix), recipe, recipe_path, overrides, base_model, output_dir, None)
    return missing


def _report(
    trainer: Any, recipe: Recipe, recipe_path: str, overrides: list[str], base_model: str, output_dir: Path,
    started: float,
) -> None:  # fmt: skip
    """Main process: write `run_summary.json` and the final model's card, print where the outputs are."""
    log_history = trainer.prorl_log_history  # the whole run, also across a resume
    seconds = round(time.time() - started, 1)
    safety = {
        "cudnn_attention_guard": trainer.cudnn_attention_guard.as_dict(),
        "nonfinite_skipped_steps": trainer.prorl_nonfinite_skips,
        "on_demand_resets": trainer.prorl_on_demand_resets,  # `prorl-trl reset`: step, from/to phase, reason
    }
    summary = _write_run_files(log_history, recipe, recipe_path, overrides, base_model, output_dir, seconds, safety)
    final = output_dir / "final"
    print(f"\ndone in {summary['seconds']:.0f}s, {summary['steps']} steps.", file=sys.stdout)
    if trainer.prorl_nonfinite_skips:
        steps = ", ".join(str(event["step"]) for event in trainer.prorl_nonfinite_skips)
        print(f"  skipped (gradients not finite): global steps {steps}; batches kept in {output_dir / 'nonfinite'}/")
    for reset in trainer.prorl_on_demand_resets:
        why = f": {reset['reason']}" if reset["reason"] else ""
        print(f"  reset on demand at global step {reset['step']}: phase {reset['from_phase']} -> {reset['to_phase']}"
              f" ({reset['steps_not_trained']} planned steps not trained){why}")  # fmt: skip
    for key, value in sorted(summary["final_eval"].items()):
        print(f"  {key}: {value:.4g}")
    print(f"outputs:  {output_dir}/")
    print(f"  final model:  {final}/" + ("" if final.exists() else " (not written)"))
    print(f"  recipe:       {output_dir / 'recipe.yaml'}")
    print(f"  summary:      {output_dir / 'run_summary.json'}")
    tensorboard = _tensorboard_logs(output_dir)
    if tensorboard is not None:
        print(f"  TensorBoard:  {tensorboard}/  (tensorboard --logdir {tensorboard})")


def _tensorboard_logs(output_dir: Path) -> Path | None:
    """The TensorBoard folder the run logged to (`prorl_trackers.json`), None without one or when unreadable (the
    run is done: a line of its report never fails it)."""
    from ..files import UnreadableFileError
    from ..trainer.manifest import read_tracker_ids

    try:
        folder = read_tracker_ids(output_dir).get("tensorboard")
    except UnreadableFileError:
        return None
    return (output_dir / folder) if folder else None  # an absolute `folder` stays itself


def _disk_full_message(output_dir: Path, error: BaseException, command: str) -> str:
    state = inspect_output_folder(output_dir)
    cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    where = (
        f"The last complete checkpoint is {describe_checkpoint(state)}; the files of the save that failed are "
        "ignored on resume."
        if state.latest_checkpoint is not None
        else "No checkpoint was completed yet: resuming starts from the beginning."
    )
    return (
        f"error: the disk holding {output_dir}/ is full ({free_bytes(output_dir) / 2**20:.1f} MiB free; {cause}).\n"
        f"{where}\nFree some space, then resume with:\n  {command}"
    )
