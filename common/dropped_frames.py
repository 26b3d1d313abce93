"""What a socket's reader does with frames it cannot use, at a bounded cost.

A peer that sprays junk at a socket (a bug, a port scan, a stranger on a cluster without a
secret) must cost its reader a bounded slice of each turn of its loop, never the heartbeat and the
requests behind it: every reader takes at most ``MAX_FRAMES_PER_TURN`` frames a turn, and every
dropped frame is counted (a metric per socket) but logged at most once per interval, with how
many were dropped since the last line. Logging each of 100,000 frames took a decode worker 14 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# Frames one turn of a loop reads from one socket before it moves on (heartbeats, steps, the
# other sockets); what is left waits for the next turn.
MAX_FRAMES_PER_TURN = 256
# At most one log line per socket per this many seconds.
LOG_INTERVAL_S = 5.0


class DroppedFrames:
    """Counts and logs the frames one socket drops: ``count`` is called for every one (a
    labelled metric's ``inc``), the log hears of the first and then at most one per interval."""

    def __init__(
        self,
        socket_name: str,
        count: Callable[[], None],
        log: logging.Logger,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = socket_name
        self._count = count
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._logged_at = -float("inf")
        self._unlogged = 0
        self.total = 0

    def drop(self, reason: str) -> None:
        self._count()
        self.total += 1
        now = self._clock()
        if now - self._logged_at < self._interval_s:
            self._unlogged += 1
            return
        since = f"; {self._unlogged} more dropped since the last report" if self._unlogged else ""
        self._log.warning("%s: dropped a frame: %s%s", self._name, reason, since)
        self._logged_at = now
        self._unlogged = 0
