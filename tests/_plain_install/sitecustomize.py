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
