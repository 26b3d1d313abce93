"""Serving a worker's sockets, and its heartbeat, while its main loop is inside a step.

A prefill step on a CPU takes hundreds of milliseconds. A decode worker that asks for the pages
of a prompt finished one step earlier would otherwise wait for the whole next step before the
prefill worker's loop reads its request: the client sees that wait as the gap between its first
and second token. And a worker whose heartbeat waited for its step to end would look dead to
the router whenever a step outlasted the heartbeat timeout. ``StepIO`` hands both to a helper
thread for the duration of a step:

    with step_io:        # the main loop calls nothing the helper touches until the block ends
        logits = forward(inputs)  # the forward and the sampling of a step

The helper sleeps in ``zmq.Poller`` on the sockets (no GIL held, so the step's kernels are not
slowed) and calls ``serve`` when one has traffic, and ``pulse`` (which sends a heartbeat when one
is due) after every wake-up. Exactly one thread uses the sockets at any time: the helper only
inside the page, the main loop only outside it, with a lock between.

On a GPU the pulse needs no thread: the forward is launched, not run, and the host is free
until it waits for the logits. With ``pulse_inline`` the main loop pulses itself there
(``device_launched``: the previous step's output, a heartbeat when due), and the helper only
serves the sockets, waking for a step only while they have something in flight (a prompt's KV
pages, received off the step's thread): a step of a millisecond cannot afford two thread
switches and a GIL handed back and forth for every step's output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

# How long the helper sleeps in one poll. A step's end cuts the poll short (a byte on a pipe),
# so this bounds only how late a pulse can be.
_POLL_MS = 50
# How often the helper pulses inside a step: it wakes on this timer, never at a step's start,
# so a short step (a GPU decode step is a millisecond) costs no thread switch at all.
_PULSE_S = 0.05


class StepIO:
    def __init__(
        self,
        serve: Callable[[], None] | None,
        sockets: list[zmq.Socket] | Callable[[], list[zmq.Socket]],
        pulse: Callable[[], None] | None = None,
        pulse_now: Callable[[], bool] | None = None,
        pulse_inline: bool = False,
    ) -> None:
        self._serve = serve
        self._pulse = pulse
        # The main loop pulses itself once the forward is launched; the helper never does.
        self._pulse_inline = pulse_inline
        # Whether the pulse has work at a step's start (output to send): then the helper is
        # woken to do it beside the forward instead of at its next timer.
        self._pulse_now = pulse_now
        # The sockets whose traffic calls for ``serve``: a fixed list, or asked afresh at each
        # step's start and after each serve (a decode worker's senders come and go). Only the
        # thread inside the step asks: the main loop at its start, then the helper.
        if callable(sockets):
            self._sockets_of = sockets
        else:
            fixed = list(sockets)
            self._sockets_of = lambda: fixed
        # A step's end writes a byte here to cut the helper's poll short.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._polled: list[zmq.Socket] = []  # the sockets registered beside the pipe
        self._state = threading.Condition()
        self._active = False  # the main loop is inside a step
        self._serving = False  # this step has sockets to serve: the helper polls them
        self._busy = False  # the helper is polling, serving or pulsing
        self._closed = False
        # Set at a step's start that has output to send: the helper pulses at once. A flag, not
        # only a notify, so a start that comes while the helper is not yet waiting is not lost.
        self._pulse_due = False
        self._thread = threading.Thread(target=self._run, name="step-io", daemon=True)
        self._thread.start()

    def __enter__(self) -> StepIO:
        serving = self._serve is not None and bool(self._sockets_of())
        with self._state:
            self._active = True
            self._serving = serving
            # Traffic may be waiting now, or output to send; plain pulses wait for the timer.
            if not self._pulse_inline and self._pulse_now is not None and self._pulse_now():
                self._pulse_due = True
            if serving or self._pulse_due:
                self._state.notify_all()
        return self

    @property
    def pulse_inline(self) -> bool:
        """Whether the main loop pulses itself (and so uses the pulse's sockets inside a step)."""
        return self._pulse_inline

    def device_launched(self) -> None:
        """The step's forward is launched: pulse here where the pulse is inline (the helper is
        at work otherwise)."""
        if self._pulse_inline and self._pulse is not None:
            self._pulse()

    def __exit__(self, *exc_info) -> None:
        with self._state:
            self._active = False
            if self._busy:
                if self._serving:  # the helper may be in its poll: cut it short
                    with contextlib.suppress(BlockingIOError):  # full: a wake-up is there
                        os.write(self._wake_write, b"\0")
                while self._busy:
                    self._state.wait()

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._active = False
            self._state.notify_all()
        self._thread.join(timeout=5)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _run(self) -> None:
        while True:
            with self._state:
                if not (self._active and (self._serving or self._pulse_due)):
                    # Nothing to do at once: wake for the pulse timer, or a step's start that
                    # brings sockets to serve or output to send.
                    self._state.wait(_PULSE_S)
                pulse_first, self._pulse_due = self._pulse_due, False
                if self._closed:
                    return
                # With the pulse inline, a step without sockets to serve has nothing for it.
                if not self._active or (self._pulse_inline and not self._serving):
                    continue
                serving = self._serving
                self._busy = True
            pulse = None if self._pulse_inline else self._pulse
            try:
                if pulse is not None and (pulse_first or not serving):
                    pulse()  # output waiting goes out before anything else
                if serving:
                    self._poll_and_serve()
                    if pulse is not None:
                        pulse()
            except Exception:  # a socket error must not kill the helper; the loop sees it too
                logger.exception("serving sockets during a step failed")
            finally:
                with self._state:
                    self._busy = False
                    self._state.notify_all()

    def _poll_and_serve(self) -> None:
        """Poll this step's sockets (and the wake-up pipe) once; serve any traffic."""
        assert self._serve is not None
        sockets = [sock for sock in self._sockets_of() if not sock.closed]
        if sockets != self._polled:
            for sock in self._polled:
                with contextlib.suppress(KeyError):
                    self._poller.unregister(sock)
            for sock in sockets:
                self._poller.register(sock, zmq.POLLIN)
            self._polled = sockets
        ready = dict(self._poller.poll(_POLL_MS))
        if ready.pop(self._wake_read, None):
            self._drain_wake_ups()
        if ready:
            self._serve()

    def _drain_wake_ups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass
