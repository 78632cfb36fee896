"""The suite's own set-up: processes started by tests see a plain install (`tests/_plain_install`), the pytest
process sees the dev extras, so the QLoRA and tracker tests still run against the real packages."""

import importlib.util
import os
import subprocess
import sys

from conftest import PLAIN_INSTALL

OPTIONAL = ("bitsandbytes", "wandb", "mlflow", "trackio")


def test_started_processes_do_not_find_the_optional_packages_the_pytest_process_has():
    assert str(PLAIN_INSTALL) in os.environ["PYTHONPATH"].split(os.pathsep)
    assert all(importlib.util.find_spec(name) is not None for name in OPTIONAL), "the dev extras are not installed"
    code = ("import importlib.util, sys; from peft.import_utils import is_bnb_available; "
            "print([importlib.util.find_spec(n) is None for n in sys.argv[1:]], is_bnb_available(), "
            "importlib.util.find_spec('tensorboard') is not None)")  # fmt: skip
    seen = subprocess.run([sys.executable, "-c", code, *OPTIONAL], capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["[True,", "True,", "True,", "True]", "False", "True"], seen.stdout + seen.stderr
