"""The symbolic check's worker processes (issue 13, items 3, 8 and 9): a per-item time bound that holds on any thread
and includes worker start-up (the item right after a timeout runs on a warm spare), timeouts skipped and reported as
`rewards/<name>/timeouts`, a pool that survives `os.fork()` while another thread is grading, workers that die with
their parent even on SIGKILL, items taking turns across threads, and untrusted text that never executes.

Timings here are loose (a shared 2-core machine); the measured worst cases are in
benchmarks/results/rewards_throughput.md. Cost: about 40 s of wall time, mostly waiting for deliberate timeouts.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from rewards import get_reward
from rewards._verify import TIMEOUT, VerifyPool, shared_pool

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
SYMBOLIC = ([r"\boxed{x+1}"], [r"\frac{x^2-1}{x-1}"])  # needs math-verify: no fast path decides it
# Worst cases of the issue: sympy expands (x+1)^9999 for a minute, and 2^(999!) never ends.
PATHOLOGICAL = [(r"\boxed{(x+1)^{9999}}", "1"), (r"\boxed{2^{999!}}", "2")]


def wait_until_warm(pool: VerifyPool) -> None:
    """Block until every worker of the pool is started and idle (spares warm), as between training steps."""
    ready = pool.wait_until_warm(120.0)
    with pool._condition:
        state = (len(pool._idle), len(pool._busy), len(pool._starting), pool._to_start, pool._closed, pool._error)
    assert ready, f"the math-verify workers did not become ready: {state}"


def run_on(thread_kind: str, function):
    if thread_kind == "main":
        return function()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=function()), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "math_equivalence hung on a worker thread"
    return result["value"]


@pytest.mark.parametrize("thread_kind", ["main", "worker"])
def test_time_bound_holds_and_the_item_after_a_timeout_runs_on_a_warm_spare(thread_kind):
    """Each pathological item is cut off at the limit and skipped (None, not "incorrect"); the symbolic item right
    after it is checked by a warm spare within the same bound (a cold worker took ~1.5 s and failed it)."""
    reward = get_reward("math_equivalence")  # timeout_seconds=1.0
    reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1])
    pool = shared_pool()
    for completion, gold in PATHOLOGICAL:
        wait_until_warm(pool)
        metrics: list = []
        timeouts_before = pool.timeouts

        def grade():
            start = time.monotonic()
            values = reward(
                completions=[completion, *SYMBOLIC[0]],
                answer=[gold, *SYMBOLIC[1]],
                log_metric=lambda name, value: metrics.append((name, value)),
            )
            return values, time.monotonic() - start

        values, seconds = run_on(thread_kind, grade)
        assert values == [None, 1.0], completion
        assert pool.timeouts == timeouts_before + 1
        assert metrics == [("rewards/math_equivalence/timeouts", 1.0)]
        assert seconds < 2 * 1.0 + 2.0  # two items of at most 1 s each, plus slack for a loaded machine


def test_timeout_can_score_incorrect_and_length_rewards_report_their_own_timeouts():
    reward = get_reward("math_equivalence", timeout_is_incorrect=True)
    assert reward.__name__ == "math_equivalence_timeout_is_incorrectTrue"
    reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1])
    wait_until_warm(shared_pool())
    assert reward(completions=[PATHOLOGICAL[1][0]], answer=["2"]) == [0.0]
    metrics: list = []
    cosine = get_reward("cosine_scaled", max_len=10)  # checker: math_equivalence
    wait_until_warm(shared_pool())
    values = cosine(
        completions=[PATHOLOGICAL[1][0], SYMBOLIC[0][0]],
        completion_ids=[[0], [0]],
        answer=["2", SYMBOLIC[1][0]],
        log_metric=lambda name, value: metrics.append((name, value)),
    )
    assert values[0] is None and values[1] == pytest.approx(cosine.value(True, 1))
    assert metrics == [("rewards/cosine_scaled_max_len10/timeouts", 1.0)]
    metrics.clear()  # a call without timeouts still reports, so the logged mean is per call
    get_reward("math_equivalence")(completions=["x"], answer=["1"], log_metric=lambda n, v: metrics.append((n, v)))
    assert metrics == [("rewards/math_equivalence/timeouts", 0.0)]


def test_guard_trl_hands_rewards_a_log_metric_hook():
    """Guard (trl==1.16.0): `_calculate_rewards` passes `log_metric` to every reward function, and `_log_metric`
    collects the value under the name given (averaged per logging step). The timeouts metric relies on both."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._calculate_rewards)
    assert 'reward_kwargs["log_metric"] = self._log_metric' in source
    assert "self._pending_metrics[name].append(value)" in inspect.getsource(GRPOTrainer._log_metric)


def _wait_for_child(pid: int, read_fd: int, seconds: float) -> bytes | None:
    readable, _, _ = select.select([read_fd], [], [], seconds)
    if not readable:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    data = os.read(read_fd, 65536)
    os.waitpid(pid, 0)
    return data


def test_fork_while_another_thread_is_inside_the_reward():
    """A process forked while a thread of the parent is grading (datasets' `map(num_proc=...)`, DataLoader workers)
    starts its own workers instead of waiting forever on a lock the parent's thread held at the fork."""
    reward = get_reward("math_equivalence", timeout_seconds=4.0, prescreen=False)
    reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1])
    inside = threading.Event()

    def grade_slowly():
        inside.set()
        reward(completions=[PATHOLOGICAL[1][0]], answer=["2"])  # holds a worker for 4 s

    thread = threading.Thread(target=grade_slowly, daemon=True)
    thread.start()
    inside.wait()
    time.sleep(0.5)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grade, report, leave without running the parent's cleanup
        try:
            os.close(read_fd)
            values = reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1])
            os.write(write_fd, json.dumps(values).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        output = _wait_for_child(pid, read_fd, seconds=90)
    finally:
        os.close(read_fd)
    thread.join(timeout=30)
    assert output is not None, "the forked child hung on its first symbolic check"
    assert json.loads(output) == [1.0]
    assert reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1]) == [1.0]  # the parent's pool is untouched


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


PARENT = r"""
import json, sys, threading, time
import rewards
from rewards._verify import shared_pool

reward = rewards.get_reward("math_equivalence", timeout_seconds=600, prescreen=False)
reward(completions=[r"\boxed{x+1}"], answer=[r"\frac{x^2-1}{x-1}"])
if sys.argv[1] == "busy":  # one worker deep in a C-level computation when the parent dies
    threading.Thread(target=reward, kwargs=dict(completions=[r"\boxed{2^{999!}}"], answer=["2"]), daemon=True).start()
    time.sleep(1.0)
print(json.dumps(shared_pool().pids()), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("state", ["idle", "busy"])
def test_workers_die_with_their_parent_even_on_sigkill(state):
    """SIGKILL leaves no chance for cleanup code, and the workers sit in their own session, so a process-group kill
    misses them: they must notice on their own (parent-death signal, parent watchdog)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, state], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 3 and all(_alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:  # never leave them running, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"math-verify workers outlived their SIGKILLed parent: {survivors}"


def test_items_take_turns_across_threads():
    """With one worker and 8 threads grading 2 items each, every thread's first item is served before any second
    item: turns are per item, so a short call never waits for other threads' whole batches."""
    pool = VerifyPool(size=1)
    try:
        assert pool.check(*SYMBOLIC[1], "x+1", 60.0) is True  # warm
        order: list[tuple[int, int]] = []
        lock = threading.Lock()

        def grade(thread_index: int):
            for item in range(2):
                assert pool.check(*SYMBOLIC[1], "x+1", 30.0) is True
                with lock:
                    order.append((thread_index, item))

        worker, _ = pool._acquire(30.0)  # hold the only worker until all 8 first items are in line
        threads = [threading.Thread(target=grade, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        while len(pool._queue) < 8:
            time.sleep(0.01)
        pool._release(worker)
        for thread in threads:
            thread.join(timeout=120)
        assert len(order) == 16
        assert sorted(thread for thread, item in order[:8]) == list(range(8)) and all(i == 0 for _, i in order[:8])
    finally:
        pool.close()


def test_eight_threads_grading_at_once_all_finish_correctly():
    reward = get_reward("math_equivalence")
    reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1])
    wait_until_warm(shared_pool())
    results: dict = {}
    barrier = threading.Barrier(8)

    def grade(index: int):
        barrier.wait()
        start = time.monotonic()
        values = reward(completions=[r"\boxed{x+2}", r"\boxed{3}"], answer=[r"\frac{x^2-4}{x-2}", r"\log_2 8"])
        results[index] = (values, time.monotonic() - start)

    threads = [threading.Thread(target=grade, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(values == [1.0, 1.0] for values, _ in results.values()) and len(results) == 8
    assert max(seconds for _, seconds in results.values()) < 10  # 16 items of ~20 ms on 3 workers (13.2 s before)


def test_closing_the_shared_pool_frees_its_workers_and_the_next_use_starts_new_ones():
    """A benchmark or test that closes the shared pool must not leave later rewards timing out on a dead pool."""
    reward = get_reward("math_equivalence")
    assert reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1]) == [1.0]
    pool = shared_pool()
    pids = pool.pids()
    pool.close()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids and not any(_alive(pid) for pid in pids)
    assert reward(completions=SYMBOLIC[0], answer=SYMBOLIC[1]) == [1.0]
    assert shared_pool() is not pool


# ----------------------------------------------------------------------------------------------- item 9: no eval

INJECTIONS = [
    "__import__('os').system('touch {path}')",
    '__import__("os").system("touch {path}")',
    "open('{path}', 'w').close()",
    "eval(\"open('{path}', 'w')\")",
    "exec(\"open('{path}', 'w')\")",
    "x + __import__('os').system('touch {path}')",
    "getattr(__builtins__, 'open')('{path}', 'w')",
    "().__class__.__base__.__subclasses__()",
    "sympify(\"open('{path}', 'w')\")",
    "lambdify(x, \"open('{path}', 'w')\")",
    "\\text{{__import__('os').system('touch {path}')}}",
    "1 + open('{path}','w').close()",
]


def test_untrusted_text_never_executes(tmp_path):
    """Injection strings as golds and as answers (boxed, unboxed, GSM8K-style) create no file: golds are rejected
    as not math (None), answers score 0. The control shows each payload does run under an `eval` (sympy's
    `parse_expr`), which is what math-verify's expression extraction ends in."""
    from sympy.parsing.sympy_parser import parse_expr

    marker = tmp_path / "pwned"
    payloads = [injection.format(path=marker) for injection in INJECTIONS]
    reward = get_reward("math_equivalence", timeout_seconds=5.0)
    for payload in payloads:
        completions = [rf"\boxed{{{payload}}}", payload, r"\boxed{1}", rf"\boxed{{{payload}}}"]
        golds = ["1", "1", payload, payload]
        values = reward(completions=completions, answer=golds)
        assert values[0] == 0.0 and values[1] == 0.0 and values[2] is None and values[3] is None, payload
        assert reward(completions=[rf"\boxed{{{payload}}}"], answer=[f"#### {payload}"]) in ([None], [0.0])
        assert not marker.exists(), f"payload ran: {payload}"
    parse_expr(payloads[2])  # control: the same text under an eval does create the file
    assert marker.exists()
