"""Test-only: how the 2-process test workers end, once their results are written and the group is left together."""

import os
import sys


def exit_without_finalization() -> None:
    """Exit 0 without interpreter finalization, where a gloo rank can still abort (SIGABRT, "terminate called without
    an active exception"; rank 1 of the suite's DDP worker, 2026-11-29, after its last phase). That abort is not what
    the tests check; the CLI's own exit (`recipe.run.leave_process_group`, then a normal exit) is tested apart."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
