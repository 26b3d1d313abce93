"""Graceful drain: what a worker does between SIGTERM and its exit.

Kubernetes sends SIGTERM when it scales a pool down or replaces a pod, and SIGKILL
``terminationGracePeriodSeconds`` later (30 s unless the pod says otherwise). In between the
worker:

1. tells the router it is draining (``WorkerDraining``), so that nothing new is routed to it;
   requests already on their way are still taken and served;
2. serves what it holds (a prefill worker its queued prompts and the pages it handed off, until
   their decode workers have fetched them; a decode worker its running sequences and the
   handoffs on their way) until it holds nothing or ``--drain-timeout`` is near;
3. leaves (``WorkerDraining`` with ``leaving``): the router moves whatever it still has on the
   worker elsewhere, as when a worker dies (a decode worker's sequences migrate with their
   tokens so far, a prefill worker's prompts are dispatched again), and answers ``LeaveAck``
   once it has read everything the worker sent before;
4. exits 0.

So a client's request is never lost: it finishes here, or it continues on another worker.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import time
from collections.abc import Callable

from common.protocol import LeaveAck, WorkerDraining
from common.service.router_link import RouterLink

logger = logging.getLogger(__name__)

# Below Kubernetes' default terminationGracePeriodSeconds (30 s): the worker is out before the
# SIGKILL. deploy/kubernetes sets both, and its test checks that they agree.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
# While draining, the announcement is repeated this often: a router that restarted (or a
# message lost with a reconnect) hears it again.
_ANNOUNCE_EVERY_S = 1.0
# Kept from the drain timeout for leaving: the router's LeaveAck comes within milliseconds
# unless the router is gone, and then the worker leaves without it.
_LEAVE_WAIT_S = 2.0


def add_drain_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drain-timeout",
        type=positive_seconds,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds from SIGTERM to exit: the worker finishes what it holds meanwhile, and "
        "the router moves what is left then to other workers (keep it below the pod's "
        "terminationGracePeriodSeconds)",
    )


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


class Drain:
    """One worker's drain. The SIGTERM handler only notes the time (``begin``); the main loop
    calls ``poll`` once a turn, which does the rest from the loop's own thread."""

    def __init__(
        self, worker_id: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the drain timeout must be positive, not {timeout_s}")
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.clock = clock
        self.leave_wait_s = min(_LEAVE_WAIT_S, timeout_s / 4)
        self.started_at: float | None = None
        self._announced_at: float | None = None

    def install(self) -> None:
        """Make SIGTERM start the drain (call from the main thread)."""
        signal.signal(signal.SIGTERM, lambda *_: self.begin())

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = self.clock()

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def poll(self, link: RouterLink, holding: int) -> bool:
        """Announce the drain (again, once a second) and say whether the worker should leave
        now: when it holds nothing (``holding`` counts its requests), or when the drain timeout
        is near; then it has left (see ``leave``). False while not draining."""
        if self.started_at is None:
            return False
        now = self.clock()
        if self._announced_at is None:
            logger.info(
                "draining: nothing new is routed here; %d requests to finish within %g s",
                holding,
                self.timeout_s,
            )
        if self._announced_at is None or now - self._announced_at >= _ANNOUNCE_EVERY_S:
            link.send(WorkerDraining(self.worker_id))
            self._announced_at = now
        if holding and now < self.started_at + self.timeout_s - self.leave_wait_s:
            return False
        if holding:
            logger.warning("drain timeout: the router moves the %d requests left here", holding)
        self.leave(link)
        return True

    def leave(self, link: RouterLink) -> None:
        """Tell the router this worker is going and wait (``leave_wait_s`` at most) for its
        ``LeaveAck``: after it, closing the sockets loses nothing this worker sent."""
        link.send(WorkerDraining(self.worker_id, leaving=True))
        deadline = self.clock() + self.leave_wait_s
        while (left := deadline - self.clock()) > 0:
            if not link.socket.poll(max(1, int(left * 1000))):
                continue
            # Anything else (aborts of what the router moved, requests that crossed the
            # announcement) is the router's to settle now: it has them on its books.
            if any(isinstance(msg, LeaveAck) for msg in link.receive()):
                logger.info("drained; leaving")
                return
        logger.warning("no answer from the router to the leave; leaving without it")
