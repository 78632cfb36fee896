"""`prorl-trl launch [ACCELERATE OPTIONS] [--] train RECIPE ...`: `accelerate launch -m prorl_trl train ...` with a
clean stop. Same options, same config files (accelerate's own parser and `launch_command` run in this process).

Why not plain `accelerate launch`: a stopped run's training processes finish their step, write a checkpoint, print
how to resume and exit 130/143, but accelerate 1.15's launcher then hides that ending under its own:
- one process (`simple_launcher`): any nonzero status raises `CalledProcessError` (a traceback, exit 1), and Ctrl-C
  raises `KeyboardInterrupt` in the launcher itself while the training process is still checkpointing;
- torchrun (`multi_gpu_launcher`: DDP, FSDP, DeepSpeed's `standard` launcher): the elastic agent forwards the
  signal, SIGKILLs the processes 30 s later (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`), often mid-checkpoint, and raises
  `SignalException`/`ChildFailedError` (a traceback, exit 1).
The training processes cannot change what their launcher prints or returns, hence this command:
- the training processes run in their own sessions: the terminal's Ctrl-C, `kill <pid>` and SLURM's signal reach
  this process, which forwards each SIGINT/SIGTERM once to every training process of this node (a second Ctrl-C
  stops them at once, without a checkpoint, as under `prorl-trl train`);
- accelerate's launch runs in a helper thread, where torch's elastic agent installs no signal handlers (it never
  kills a process that is still checkpointing); a one-process launch is started by `_simple_launcher` below;
- the ending is ours: no launcher traceback, the resume command (`prorl-trl launch ... --resume`) printed once, as
  the last line (the training process says where it stopped and leaves the command to this one), and the exit
  status says what happened.

Exit status: 0 the run finished (or had nothing to do); 75 (`INTERRUPTED`, sysexits' EX_TEMPFAIL: "temporary
failure, retry later") interrupted and resumable: every training process that did not finish stopped on SIGINT/
SIGTERM (after writing its checkpoint, or before training began): run the same command with `--resume`; 1 a
training process failed (its own error is above); 2 a bad command line. 75 rather than 130/143: a shell reports
130/143 for any process killed by SIGINT/SIGTERM, also one that never wrote a checkpoint; 75 is said only after
every process ended as a stopped run, so a job script can requeue on it alone (recipes/slurm/prorl.sbatch).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

INTERRUPTED = 75
# The `prorl-trl launch ...` command line (JSON list), for the training processes' resume command.
LAUNCH_ARGV_ENV = "PRORL_LAUNCH_ARGV"
# Statuses of a training process that stopped on a signal: `train` after a clean stop (143 SIGTERM, 130 SIGINT, also
# after a second Ctrl-C), or killed by the forwarded signal before its handler was installed (-15, -2).
STOPPED_STATUSES = (130, 143)
KILLED_BY_STOP = (-signal.SIGINT, -signal.SIGTERM)
# The script is always ours: these accelerate options would name another one.
SCRIPT_OPTIONS = ("-m", "--module", "--no_python", "--no-python")
TRAINING_SCRIPT = [
    "-m",
    "prorl_trl",
]  # accelerate's `-m MODULE` (tests run their fault-injecting script instead)

USAGE = """usage: prorl-trl launch [ACCELERATE LAUNCH OPTIONS] [--] train RECIPE [train options and overrides]

`accelerate launch -m prorl_trl train RECIPE ...` with a clean stop: SIGINT/SIGTERM make every training process
finish its step and write a checkpoint, then the command prints how to resume and exits 75 (interrupted,
resumable); no launcher traceback. The options before `train` are accelerate launch's (`accelerate launch --help`),
e.g. --config_file recipes/accelerate/cpu.yaml, --num_processes 4, and per node --num_machines, --machine_rank,
--main_process_ip, --main_process_port (recipes/accelerate/multi_node.yaml). Exit status: 0 finished, 75
interrupted and resumable (run it again with --resume), 1 a training process failed, 2 bad command line.

  prorl-trl launch --config_file recipes/accelerate/cpu.yaml train recipes/demo_tiny.yaml
"""


class LaunchUsageError(Exception):
    """The command line of `prorl-trl launch` is wrong (exit 2)."""


def split_launch_argv(tokens: list[str], parser: Any) -> tuple[list[str], list[str]]:
    """(accelerate's options, `train RECIPE ...`) of the words after `launch`; which accelerate option takes a value
    is read from accelerate's own parser, so a value is never taken for the `train` that starts the rest."""
    takes_value = {name: action.nargs != 0 for action in parser._actions for name in action.option_strings}
    options, index = [], 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--":
            index += 1
            break
        if not token.startswith("-"):  # `train`, or a word that should have been it
            break
        name = token.split("=", 1)[0]
        if name in SCRIPT_OPTIONS:
            raise LaunchUsageError(f"{token}: the training script of `prorl-trl launch` is always `-m prorl_trl`")
        if name not in takes_value:
            raise LaunchUsageError(
                f"{token!r} is not an option of `accelerate launch`; give accelerate's options, then `train RECIPE`"
            )
        options.append(token)
        if takes_value[name] and "=" not in token and index + 1 < len(tokens):
            options.append(tokens[index + 1])
            index += 1
        index += 1
    rest = tokens[index:]
    if not rest or rest[0] != "train" or len(rest) < 2:
        got = f" (got {shlex.join(rest[:2])!r})" if rest else ""
        raise LaunchUsageError(f"expected `train RECIPE ...` after accelerate's options{got}")
    return options, rest


def _check_inputs(options: list[str], train: list[str], recipe_of: Callable[[list[str]], str | None]) -> None:
    """Refuse, before accelerate starts anything, a `--config_file` that is not a readable file and a recipe that
    cannot be read (`train` reports every other problem of the recipe, in each process). `recipe_of` finds RECIPE
    among the words after `train` as the CLI's parser does (passed in: this module sits beside the CLI, not under)."""
    from .recipe.preflight import read_launch_config
    from .recipe.reading import read_recipe_file
    from .recipe.schema import RecipeError

    for index, token in enumerate(options):
        name, has_value, value = token.partition("=")
        if name not in ("--config_file", "--config-file"):
            continue
        value = value if has_value else (options[index + 1] if index + 1 < len(options) else "")
        config = Path(value)
        problem = "does not exist" if not config.exists() else "is not a file" if not config.is_file() else (
            "cannot be read" if not os.access(config, os.R_OK) else None
        )  # fmt: skip
        if problem:
            raise LaunchUsageError(
                f"{name} {value}: the accelerate config file {problem}. Pass an existing file (e.g. "
                "recipes/accelerate/single_gpu.yaml), or leave the option out to use `accelerate config`'s default."
            )
        try:
            read_launch_config(config)
        except RecipeError as error:
            raise LaunchUsageError(error.render()) from None
    recipe = recipe_of(train[1:])
    if recipe is not None:
        try:
            read_recipe_file(recipe)
        except RecipeError as error:
            raise LaunchUsageError(error.render()) from None


def launch_status(statuses: list[int], stopped: bool) -> int:
    """This command's exit status from the training processes' statuses; `stopped`: a stop signal was forwarded.
    Every failed process refusing its input (exit 2: nothing was trained) is exit 2 too."""
    failed = [status for status in statuses if status != 0]
    if not failed:
        return 0
    if all(status == 2 for status in failed):
        return 2
    if all(status in STOPPED_STATUSES or (stopped and status in KILLED_BY_STOP) for status in failed):
        return INTERRUPTED
    return 1


class _ElasticThreadWarning(logging.Filter):
    """Drops torch's warning that its elastic agent, run in a thread on purpose here, installs no signal handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in str(record.msg)


def _simple_launcher(statuses: list[int]) -> Any:
    """accelerate's `simple_launcher` (one process, and CPU) with the process in its own session and its status kept,
    instead of raised as `CalledProcessError` (accelerate/commands/launch.py)."""
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    def launcher(args: Any) -> None:
        command, environment = prepare_simple_launcher_cmd_env(args)
        statuses.append(subprocess.Popen(command, env=environment, start_new_session=True).wait())

    return launcher


def _run_accelerate(args: Any, outcome: dict[str, Any]) -> None:
    """The helper thread: accelerate's `launch_command`; the training processes' statuses go into `outcome`."""
    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    statuses: list[int] = []
    accelerate_launch.simple_launcher = _simple_launcher(statuses)  # looked up by `launch_command` when it runs
    try:
        accelerate_launch.launch_command(args)
        outcome["statuses"] = statuses or [0]
    except ChildFailedError as error:  # torchrun: the processes that did not end with 0
        outcome["statuses"] = [failure.exitcode for failure in error.failures.values()]
    except BaseException as error:  # noqa: BLE001 - a launcher error (bad option, rendezvous): raised in the main thread
        outcome["error"] = error


def _forward(signum: int, children: list[Any], signalled: set[int]) -> None:
    for child in children:
        try:
            os.kill(child.pid, signum)
            signalled.add(child.pid)
        except ProcessLookupError:
            pass


def _command_argv(tokens: list[str]) -> list[str]:
    """This command as the user would type it again (`prorl-trl launch ...`, or `python -m prorl_trl launch ...`)."""
    program = ["prorl-trl"] if Path(sys.argv[0]).name == "prorl-trl" else [sys.executable, "-m", "prorl_trl"]
    return program + ["launch", *tokens]


def run_launch(tokens: list[str], recipe_of: Callable[[list[str]], str | None] = lambda words: None) -> int:
    """`prorl-trl launch TOKENS`: run accelerate's launch with the stop handling of the module doc; the exit status.
    `recipe_of`: the recipe path among the words after `train` (the CLI's parser), checked before anything starts."""
    import psutil
    from accelerate.commands.launch import launch_command_parser

    from .recipe.output_folder import resume_command

    if tokens in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    parser = launch_command_parser()
    try:
        options, train = split_launch_argv(tokens, parser)
    except LaunchUsageError as error:
        print(f"{USAGE}\nerror: {error}", file=sys.stderr)
        return 2
    try:
        _check_inputs(options, train, recipe_of)
    except LaunchUsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args([*options, *TRAINING_SCRIPT, *train])
    os.environ[LAUNCH_ARGV_ENV] = json.dumps(_command_argv(tokens))  # inherited by the training processes
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ElasticThreadWarning())

    outcome: dict[str, Any] = {}
    received: list[int] = []
    signalled: set[int] = set()
    me = psutil.Process()

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        _forward(signum, me.children(), signalled)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    worker = threading.Thread(
        target=_run_accelerate,
        args=(args, outcome),
        name="accelerate-launch",
        daemon=True,
    )
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            if received:  # a process started after the stop was asked for gets it too
                _forward(
                    received[0],
                    [c for c in me.children() if c.pid not in signalled],
                    signalled,
                )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, SystemExit):
            return int(error.code or 0) if isinstance(error.code, int) else 1
        raise error
    status = launch_status(outcome["statuses"], stopped=bool(received))
    if status == INTERRUPTED:
        reason = signal.Signals(received[0]).name if received else "a signal"
        print(
            f"\ninterrupted by {reason}; every training process stopped (exit status {INTERRUPTED}: interrupted, "
            f"resumable)\nresume with:\n  {resume_command()}",
            flush=True,
        )
    elif status != 0:
        shown = ", ".join(str(s) for s in sorted(set(outcome["statuses"])) if s != 0)
        print(
            f"error: a training process failed (exit status {shown}); its error is above.",
            file=sys.stderr,
        )
    return status
