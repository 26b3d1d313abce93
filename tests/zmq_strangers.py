"""Sending as a peer that the other side refuses at the handshake (no cluster secret)."""

from __future__ import annotations

import contextlib

import zmq

# How long a stranger's send may wait for a connection to take it.
SEND_TIMEOUT_MS = 5000


def send_unless_refused(sock: zmq.Socket, payload: bytes) -> None:
    """Send ``payload`` from a DEALER or PUSH socket whose peer may refuse its handshake. Such a
    socket blocks a send while it has no connection to queue it on, and one stranger's send once
    waited out a test's whole 600 s limit on a loaded 2-core machine (the refusal, it seems, had
    dropped the connection first): the send waits ``SEND_TIMEOUT_MS`` at most. Either way the
    refusal is the peer's to count, and what a test asserts."""
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    with contextlib.suppress(zmq.Again):
        sock.send(payload)
