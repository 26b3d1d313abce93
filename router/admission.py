"""Admission: whether a request is dispatched now, waits in the router's queue, or is refused at
once with a 429 that says when to come back.

Two limits, both off by default: vLLM queues without bound, and a deployment that sets neither
keeps that behaviour.

- ``max_inflight_per_worker``: a worker holding that many requests takes no more; routing passes
  it by. When every worker of a pool a request needs is full, the request waits in the router's
  queue, ordered by its ``priority`` (lower first, as vLLM's priority scheduling orders it) and
  then by arrival, and is dispatched as the workers finish requests.
- ``max_queue_delay_s``: how long a request is predicted to wait before its work starts, from
  what every worker reports of its load and pace: its queued prompt tokens over its prefill rate,
  its waiting sequences over its finishing rate, and, for a request that would wait here, the
  requests queued ahead of it over the decode pool's finishing rate. Past the limit the request
  is refused at once: 429, with ``Retry-After`` the seconds until the prediction is under it. A
  worker that has measured no pace yet predicts no wait: nothing is refused on a guess.

An accepted request is never refused later: it completes, once.

Pure functions over the registry's worker states, so the rules are tested without sockets.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.registry import WorkerState


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_queue_delay_s: float | None = None  # None: nothing is refused for its predicted wait
    max_inflight_per_worker: int | None = None  # None: a worker takes whatever it is sent

    def __post_init__(self) -> None:
        if self.max_queue_delay_s is not None and not self.max_queue_delay_s > 0:
            raise ValueError("--max-queue-delay must be > 0 seconds")
        if self.max_inflight_per_worker is not None and self.max_inflight_per_worker < 1:
            raise ValueError("--max-inflight-per-worker must be >= 1")


class Overloaded(Exception):
    """A request predicted to wait past ``max_queue_delay_s`` (the HTTP edge answers 429)."""

    def __init__(self, predicted_s: float, limit_s: float) -> None:
        super().__init__(
            f"the server is overloaded: this request would wait about {predicted_s:.1f} s before "
            f"its work starts, past the limit of {limit_s:g} s (--max-queue-delay); retry later"
        )
        self.predicted_s = predicted_s
        # When the queue ahead will have drained under the limit, at the pace measured now.
        self.retry_after_s = max(1, math.ceil(predicted_s - limit_s))


def is_full(worker: WorkerState, config: AdmissionConfig) -> bool:
    limit = config.max_inflight_per_worker
    return limit is not None and len(worker.inflight) >= limit


def worker_wait_s(worker: WorkerState, prefills_here: bool) -> float:
    """How long new work waits on ``worker`` before it starts: its queued prompt tokens at its
    prefill rate (when it prefills the request), and its waiting sequences at its finishing rate
    (each waits for a running one to finish). 0 for what it has not measured."""
    wait = 0.0
    if prefills_here and worker.prefill_tokens_per_s > 0:
        wait += worker.load_tokens / worker.prefill_tokens_per_s
    if worker.num_waiting > 0 and worker.finished_per_s > 0:
        wait += worker.num_waiting / worker.finished_per_s
    return wait


def predicted_wait_s(
    prefill: WorkerState | None,
    decode: WorkerState,
    queued_ahead: int,
    decode_pool: Iterable[WorkerState],
) -> float:
    """The wait a request meets before its work starts: on its prefill worker (its decode worker
    when that one prefills it), then on its decode worker, after ``queued_ahead`` requests
    waiting in the router's queue have been dispatched as the decode pool finishes requests."""
    wait = worker_wait_s(decode, prefills_here=prefill is None)
    if prefill is not None:
        wait += worker_wait_s(prefill, prefills_here=True)
    if queued_ahead:
        pace = sum(w.finished_per_s for w in decode_pool)
        if pace > 0:
            wait += queued_ahead / pace
    return wait


@dataclass(order=True, slots=True)
class _Waiting:
    priority: int
    arrival: int
    group: list = field(compare=False)  # the generations of one prompt, dispatched together


class WaitingQueue:
    """Requests that wait for a worker with room: lowest ``priority`` first, then oldest."""

    def __init__(self) -> None:
        self._heap: list[_Waiting] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, group: list, priority: int) -> None:
        heapq.heappush(self._heap, _Waiting(priority, next(self._arrivals), group))

    def peek(self) -> list:
        return self._heap[0].group

    def pop(self) -> list:
        return heapq.heappop(self._heap).group

    def ahead_of(self, priority: int) -> int:
        """How many waiting requests a new one of ``priority`` would wait behind."""
        return sum(1 for waiting in self._heap if waiting.priority <= priority)

    def remove(self, member: object) -> list | None:
        """Take out the group that holds ``member`` and return it; None if none does."""
        for index, waiting in enumerate(self._heap):
            if any(g is member for g in waiting.group):
                self._heap.pop(index)
                heapq.heapify(self._heap)
                return waiting.group
        return None
