"""Test-only launcher: `python tests/_kill_launcher.py train RECIPE ...` runs `prorl_trl.cli.main` with a fault
injected at an exact point, named by the environment (production code has no test hooks):

    PRORL_TEST_KILL_AT=EVENT:PHASE:STEP    SIGKILL this process at that point
    PRORL_TEST_TERM_AT=EVENT:PHASE:STEP    SIGTERM the parent process (the `accelerate launch` launcher) there
    PRORL_TEST_TERM_SELF_AT=EVENT:PHASE:STEP    SIGTERM this process there (as a scheduler would)
    PRORL_TEST_INT_AT=EVENT:PHASE:STEP     SIGINT the parent process (`prorl-trl launch`: Ctrl-C) there
    PRORL_TEST_REQUEST_AT=PHASE:STEP=JSON[|PHASE:STEP=JSON...]    the main process writes JSON as the run's reset
                                           request (`prorl_reset_request.json`) at on_step_begin of that step
    PRORL_TEST_RANKS_TO=DIR                every process writes DIR/rank<r>.json at each phase's end: its global step,
                                           resets, resets on demand, and a sha256 of its model's parameters
    PRORL_TEST_NAN_AT=PHASE:STEP[,PHASE:STEP...]    make that step's training forward overflow (the final norm's
                                           output times inf, as a bf16 activation that overflows): loss and every
                                           gradient NaN; generation and validation untouched

`python tests/_kill_launcher.py launch [ACCELERATE OPTIONS] train RECIPE ...` is `prorl-trl launch` whose training
processes run this file (with its faults) instead of `-m prorl_trl`.

It also registers the reward `token_hash` (deterministic, varies inside every group on a random tiny model, so every
step has a gradient and a resumed run that went wrong ends on other weights).

EVENT is `on_step_begin` (STEP = the step about to run, counted within the phase from 1), `on_save` (HF has written
checkpoint-STEP, ProRL has not committed it yet), `on_train_end` (the phase's loop is over, its last checkpoint is
committed, the next phase has not started), or `save:NAME` (a merged save into a folder called NAME, e.g. `reset-1`
or `final`, fully written but not yet renamed into place; PHASE and STEP are ignored).
"""

import os
import signal
import sys

from transformers import TrainerCallback


def _spec(name):
    value = os.environ.get(name)
    if not value:
        return None
    event, phase, step = value.rsplit(":", 2)
    return event, int(phase), int(step)


class FaultAt(TrainerCallback):
    """Sends `signum` to `pid` when the trainer reaches (event, phase, step)."""

    def __init__(self, event, phase, step, pid, signum):
        self.event, self.phase, self.step, self.pid, self.signum = event, phase, step, pid, signum
        self.trainer = None

    def bind(self, trainer):
        self.trainer = trainer

    def _maybe_fire(self, event, step):
        if event == self.event and self.trainer.current_phase.index == self.phase and step == self.step:
            os.kill(self.pid, self.signum)

    def on_step_begin(self, args, state, control, **kwargs):
        self._maybe_fire("on_step_begin", state.global_step + 1)

    def on_save(self, args, state, control, **kwargs):
        self._maybe_fire("on_save", state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._maybe_fire("on_train_end", state.global_step)


class OverflowAt(TrainerCallback):
    """Makes the training forward (gradients on) of the named steps overflow at the model's final norm."""

    def __init__(self, steps):
        self.steps, self.active, self.trainer = steps, False, None

    def bind(self, trainer):
        self.trainer = trainer
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        model.model.norm.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        import torch

        return output * float("inf") if self.active and torch.is_grad_enabled() else output

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = (self.trainer.current_phase.index, state.global_step + 1) in self.steps

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


class Bound(TrainerCallback):
    """A callback the trainer hands itself to (`bind`)."""

    trainer = None

    def bind(self, trainer):
        self.trainer = trainer


class RequestAt(Bound):
    """Writes a reset request (as `prorl-trl reset` does: temporary file + rename) at the start of the named steps."""

    def __init__(self, requests):
        self.requests = requests

    def on_step_begin(self, args, state, control, **kwargs):
        text = self.requests.get((self.trainer.current_phase.index, state.global_step + 1))
        if text is not None and self.trainer.accelerator.is_main_process:
            from prorl_trl.reset.checkpoint import write_text_atomically

            write_text_atomically(os.path.join(args.output_dir, "prorl_reset_request.json"), text)


class RanksTo(Bound):
    """Each process records what it holds at each phase's end (the last phase's record stays)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, args, state, control, **kwargs):
        import hashlib
        import json

        trainer, digest = self.trainer, hashlib.sha256()
        for name, tensor in sorted(trainer.accelerator.unwrap_model(trainer.model).state_dict().items()):
            digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        record = {"global_step": trainer.prorl_global_step, "resets": trainer.prorl_resets, "weights": digest.hexdigest(),
                  "on_demand": trainer.prorl_on_demand_resets, "phase": trainer.current_phase.index}  # fmt: skip
        with open(os.path.join(self.folder, f"rank{trainer.accelerator.process_index}.json"), "w") as file:
            json.dump(record, file)


def token_hash(completions, **kwargs):
    return [(sum(map(ord, str(text))) % 13) / 13 for text in completions]


def install() -> None:
    import prorl_trl.trainer as trainer_package
    import rewards
    from prorl_trl.reset import save

    rewards.register("token_hash")(token_hash)

    faults = []
    for name, pid, signum in (
        ("PRORL_TEST_KILL_AT", os.getpid(), signal.SIGKILL),
        ("PRORL_TEST_TERM_AT", os.getppid(), signal.SIGTERM),
        ("PRORL_TEST_TERM_SELF_AT", os.getpid(), signal.SIGTERM),
        ("PRORL_TEST_INT_AT", os.getppid(), signal.SIGINT),
    ):
        spec = _spec(name)
        if spec is None:
            continue
        event, phase, step = spec
        if event.startswith("save:"):
            folder_name, replace_dir = event.split(":", 1)[1], save._replace_dir

            def killing_replace(src, dst, folder_name=folder_name, replace_dir=replace_dir, pid=pid, signum=signum):
                if dst.name == folder_name:
                    os.kill(pid, signum)
                return replace_dir(src, dst)

            save._replace_dir = killing_replace
        else:
            faults.append((event, phase, step, pid, signum))

    overflow_steps = {
        tuple(int(part) for part in item.split(":")) for item in os.environ.get("PRORL_TEST_NAN_AT", "").split(",") if item
    }
    requests = {}
    for item in os.environ.get("PRORL_TEST_REQUEST_AT", "").split("|"):
        if item:
            where, text = item.split("=", 1)
            requests[tuple(int(part) for part in where.split(":"))] = text
    ranks_to = os.environ.get("PRORL_TEST_RANKS_TO")
    base = trainer_package.ProRLTrainer

    class FaultyTrainer(base):
        def __init__(self, *args, callbacks=None, **kwargs):
            # Passed at init, so they run before ProRL's own callback (its on_save commits the checkpoint).
            callbacks = list(callbacks or []) + [FaultAt(*fault) for fault in faults]
            callbacks += [OverflowAt(overflow_steps)] if overflow_steps else []
            callbacks += [RequestAt(requests)] if requests else []
            callbacks += [RanksTo(ranks_to)] if ranks_to else []
            super().__init__(*args, callbacks=callbacks, **kwargs)

    trainer_package.ProRLTrainer = FaultyTrainer


if __name__ == "__main__":
    install()
    if sys.argv[1:2] == ["launch"]:
        import prorl_trl.launch

        prorl_trl.launch.TRAINING_SCRIPT = [__file__]
    from prorl_trl.cli import main

    sys.exit(main(sys.argv[1:]))
