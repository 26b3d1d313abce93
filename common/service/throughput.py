"""How fast a worker clears its queue, measured over a sliding window of its recent steps: what
its heartbeats tell the router, which predicts from it how long a new request would wait
(``router/admission.py``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# Long enough to smooth a burst of short steps, short enough to follow a change of load.
WINDOW_S = 30.0


class Throughput:
    """Work done per second over the last ``window_s``: ``per_busy_second`` counts only the time
    spent working (a prefill rate: tokens per second of step), ``per_second`` wall time (a
    finishing rate). Both are 0 until something was recorded."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, float, float]] = deque()  # (at, amount, busy seconds)
        self._amount = 0.0
        self._busy = 0.0

    def record(self, amount: float, busy_seconds: float = 0.0) -> None:
        now = self._clock()
        self._events.append((now, amount, busy_seconds))
        self._amount += amount
        self._busy += busy_seconds
        self._forget(now)

    def per_busy_second(self) -> float:
        self._forget(self._clock())
        return self._amount / self._busy if self._busy > 0 else 0.0

    def per_second(self) -> float:
        now = self._clock()
        self._forget(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1.0)  # one event alone is no rate of its own
        return self._amount / span

    def _forget(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self._window_s:
            _, amount, busy = self._events.popleft()
            self._amount -= amount
            self._busy -= busy
