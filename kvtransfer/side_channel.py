"""One ZMQ socket of the KV side channel, with a strict, non-blocking receive.

Both ends use it: the sender's ROUTER (every incoming message starts with the peer's routing
id) and each receiver's DEALER. Whatever arrives that is not a valid message, or is one with
frames it should not have, is logged (rate-limited), counted and dropped; the caller only ever
sees well-formed messages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from common.messages import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode
from kvtransfer.metrics import BAD_MESSAGES

logger = logging.getLogger(__name__)

# Caps the work one poll() does on a busy socket, so a flood cannot starve the worker's loop.
MAX_MESSAGES_PER_POLL = 256
# Frames larger than this make ZMQ drop the connection before they reach memory in full.
MAX_INBOUND_FRAME_BYTES = 64 << 20
CLOSE_LINGER_MS = 1000


@dataclass(slots=True)
class Incoming:
    msg: Message
    identity: bytes | None  # the peer's routing id (ROUTER sockets only)
    frames: list[zmq.Frame]  # frames after the message (PageData only), received zero-copy


class SideChannel:
    """A socket plus the strict decoding and bad-message accounting of everything it receives."""

    def __init__(
        self,
        socket: zmq.Socket,
        backend: str,
        side: str,
        *,
        routed: bool,
        max_message_bytes: int = MAX_FRAME_BYTES,
        frames_allowed: tuple[type[Message], ...] = (),
    ) -> None:
        self.socket = socket
        self._routed = routed
        self._max_message_bytes = max_message_bytes
        self._frames_allowed = frames_allowed
        self._bad = BAD_MESSAGES.labels(backend=backend, side=side)
        self._log = _RateLimitedLog(f"{backend} {side}")

    @classmethod
    def bind(cls, host: str, port: int, backend: str, side: str, **kwargs) -> SideChannel:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # Report an unroutable reply (receiver gone) instead of dropping it silently.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Outgoing page frames point into the pool rather than holding copies, so a deep queue
        # costs no memory, and a ROUTER at its high-water mark would drop part of an answer.
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_FRAME_BYTES)
        socket.bind(f"tcp://{host}:{port}")
        return cls(socket, backend, side, routed=True, **kwargs)

    @classmethod
    def connect(
        cls, endpoint: str, backend: str, side: str, max_inbound_bytes: int, **kwargs
    ) -> SideChannel:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        # A closed DEALER still flushes its last messages (a ReleasePages) in the background.
        socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, max(max_inbound_bytes, MAX_INBOUND_FRAME_BYTES))
        socket.connect(endpoint)
        return cls(socket, backend, side, routed=False, **kwargs)

    @property
    def endpoint(self) -> str:
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def receive(self) -> list[Incoming]:
        """Every valid message waiting now (at most MAX_MESSAGES_PER_POLL); never blocks."""
        received = []
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            incoming = self._parse(parts)
            if incoming is not None:
                received.append(incoming)
        return received

    def send(
        self,
        msg: Message,
        identity: bytes | None = None,
        frames: list[zmq.Frame] | None = None,
    ) -> bool:
        """Queue ``msg`` (and zero-copy ``frames``) without blocking; False if it cannot go."""
        parts: list = [identity] if self._routed else []
        parts.append(encode(msg))
        if frames:
            parts.extend(frames)
        try:
            self.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue is full
            self._log.warning(f"could not send {type(msg).__name__}: {exc}")
            return False
        return True

    def reject(self, why: str) -> None:
        """Count and log a well-formed message that makes no sense in the current state."""
        self._bad.inc()
        self._log.warning(why)

    def close(self) -> None:
        self.socket.close()

    def _parse(self, parts: list[zmq.Frame]) -> Incoming | None:
        identity = None
        if self._routed:
            identity, parts = parts[0].bytes, parts[1:]
        if not parts:
            self.reject("empty message")
            return None
        head = parts[0]
        try:
            msg = decode(head.buffer, self._max_message_bytes)
        except ProtocolError as exc:
            self.reject(f"dropped a malformed message ({len(head)} bytes): {exc}")
            return None
        if len(parts) > 1 and not isinstance(msg, self._frames_allowed):
            self.reject(f"dropped {type(msg).__name__} carrying {len(parts) - 1} stray frames")
            return None
        return Incoming(msg, identity, parts[1:])


class _RateLimitedLog:
    """At most one warning per interval, with a count of those suppressed meanwhile."""

    def __init__(self, name: str, interval_s: float = 5.0) -> None:
        self._name = name
        self._interval_s = interval_s
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return
        suffix = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
        logger.warning("kv side channel (%s): %s%s", self._name, text, suffix)
        self._last = now
        self._suppressed = 0
