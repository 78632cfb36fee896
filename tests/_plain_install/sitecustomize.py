"""Test-only: processes the suite starts (a CLI run, a launch and its ranks, a worker, the fork server of
`tests/_cli_fork.py`) see the packages of a plain `pip install prorl-trl`, not the dev extras' optional ones.

The dev install adds bitsandbytes and the W&B, MLflow and trackio trackers so that their tests (QLoRA resets,
`report_to`) run in the pytest process. Installed, each is imported at start-up by PEFT or by TRL's profiling even
when nothing uses it: about 2.2 of the 7.2 CPU seconds of `import prorl_trl.trainer` on the 2-core CI machine
(2026-11-29), paid by every one of the suite's fresh interpreters. Here `importlib.util.find_spec` finds none of them,
as on a machine without them: the libraries' own availability checks skip them. `conftest.py` puts this folder on
`PYTHONPATH` for the processes tests start, never for the pytest processes themselves.
"""

import importlib.machinery
import sys

HIDDEN = frozenset({"bitsandbytes", "wandb", "mlflow", "trackio"})


class _PlainInstallFinder(importlib.machinery.PathFinder):
    """`PathFinder` that does not find the hidden top-level packages (nor anything inside them)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_PlainInstallFinder if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]  # fmt: skip


# In the processes the suite starts, the first explicit `gc.collect()` (HF's `Trainer.train` calls it through
# accelerate's `free_memory`, DeepSpeed at every ZeRO defragment) is followed by `gc.freeze()`: what is alive then,
# mostly the ~0.5M objects the imports created, leaves the cyclic collector, whose every later full pass had scanned
# it again (~0.5 s each). The ZeRO-2/3 smoke of tests/test_sharded_resets.py (its ranks collect dozens of times) took
# 230 CPU-s before and 98 after, on this machine. What a run creates after that call is collected as before; what was
# alive at it and turns into cyclic garbage later (a tiny model, a first trainer) stays in memory until exit.
import gc  # noqa: E402

_collect = gc.collect


def _collect_then_freeze_once(*args, **kwargs):
    collected = _collect(*args, **kwargs)
    if gc.collect is _collect_then_freeze_once:
        gc.collect = _collect
        gc.freeze()
    return collected


gc.collect = _collect_then_freeze_once
