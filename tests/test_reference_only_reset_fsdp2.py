"""The reference-only hard reset (`reset_adapter: false`, `reset_reference: true`) under FSDP2, on 2 CPU processes.

The reset zeroes TRL's "ref" adapter and copies the live delta for the reference. After a forward FSDP2's root unit
keeps its unsharded weights (here lm_head's, with its adapters); the zero must go into the shards, or the reference
is right until the next reshard (a backward) and then silently back at the old adapter. Runs
tests/_fsdp2_worker.py's `reference_only` section alone (about 15 s on 2 idle cores).
"""

import pytest
from test_ddp import two_process_results
from test_sharded_resets import FSDP2_WORKER


@pytest.fixture(scope="module")
def reference_only(tmp_path_factory):
    return two_process_results(tmp_path_factory, FSDP2_WORKER, "fsdp2_reference_only", "reference_only")


def test_fsdp2_reference_only_reset_writes_the_shards_of_the_root_unit(reference_only):
    """The reference becomes the policy as of the reset on every rank, and stays it: after a reshard, after a
    training step of the policy, and the "ref" adapter's shards hold the zeros; the same as one process."""
    assert reference_only["root_unsharded_before_reset"] == [True, True]  # the case the reset must reshard for
    record = reference_only["reference_only"]
    assert min(record["old_reference_vs_policy"]) > 1e-2  # the policy had moved away from its reference
    assert record["right_after_vs_policy"] == [0.0, 0.0]
    assert record["after_reshard_vs_policy"] == [0.0, 0.0]
    assert reference_only["ref_b_shards_zero"] == [True, True]
    assert min(record["step_moved_policy"]) > 1e-3  # the step trained the policy ...
    assert record["after_step_vs_policy_at_reset"] == [0.0, 0.0]  # ... and left the reference where the reset put it
    assert record["vs_one_process"] == [0.0, 0.0]
    assert record["factors_vs_one_process"] == [0.0, 0.0]
