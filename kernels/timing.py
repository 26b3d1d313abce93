"""Timing a call on a busy machine: what the start-up probes choose kernels by, and what the
benchmarks report."""

from __future__ import annotations

import time
from pathlib import Path


def best_seconds(fn, repeats: int = 2) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def first_is_faster(first, second, rounds: int = 4) -> bool:
    """Whether ``first`` runs at least as fast as ``second``: the fastest of ``rounds`` timed
    calls each, after one untimed call each, the two taking turns, each call timed by
    ``running_seconds``.

    What the start-up probes compare kernels by, and they persist the answer, so it must hold on
    a busy machine. Two things make it: taking turns, so that a burst of other work (workers
    starting together, a build) slows a call of each, where timing one kernel's calls back to
    back lets one burst cover all of them and reverse a 2x difference; and not counting the time
    the calling thread waited for a core, which on a machine whose cores are all busy is most of
    a call (a probe taken while tests ran beside it once kept a plan whose decode steps were
    16-25 ms slower)."""
    first()
    second()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for which, fn in enumerate((first, second)):
            best[which] = min(best[which], running_seconds(fn))
    return best[0] <= best[1]


def running_seconds(fn) -> float:
    """Seconds one call of ``fn`` took, less the time the calling thread spent ready to run but
    waiting for a core (the run-queue wait Linux keeps per thread in ``schedstat``; none is
    taken off where that is not kept). Waiting for memory still counts: the machine's other
    work can slow a kernel that way, but not reorder two kernels' calls taken in turn."""
    waited = _run_queue_seconds()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed - max(0.0, _run_queue_seconds() - waited)


_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _run_queue_seconds() -> float:
    """This thread's total time ready to run but not running, or 0 where Linux does not say."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
