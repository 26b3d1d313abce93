"""One ZMQ socket of the KV side channel, with a strict, non-blocking receive.

Both ends use it: the sender's ROUTER (every incoming message starts with the peer's routing
id) and each receiver's DEALER. Whatever arrives that is not a valid message, or is one with
frames it should not have, is logged (rate-limited), counted and dropped; the caller only ever
sees well-formed messages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import zmq

from common import cluster_auth
from common.dropped_frames import MAX_FRAMES_PER_TURN, DroppedFrames
from common.messages import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode
from kvtransfer.metrics import BAD_MESSAGES

logger = logging.getLogger(__name__)

# Caps the work one poll() does on a busy socket, so a flood cannot starve the worker's loop.
# Frames larger than this make ZMQ drop the connection before they reach memory in full.
MAX_INBOUND_FRAME_BYTES = 64 << 20
CLOSE_LINGER_MS = 1000


class Incoming:
    """A valid message; frames that follow it (PageData only) are still queued on the socket
    until ``read_frames_into`` takes them, and are dropped once the caller moves on."""

    __slots__ = ("_more", "_socket", "identity", "msg")

    def __init__(
        self, msg: Message, identity: bytes | None, socket: zmq.Socket, more: bool
    ) -> None:
        self.msg = msg
        self.identity = identity  # the peer's routing id (ROUTER sockets only)
        self._socket = socket
        self._more = more

    def read_frames_into(self, buffers: list) -> str | None:
        """Receive the following frames straight into ``buffers`` (writable, contiguous, with
        an ``nbytes``), one frame each, with no copy in between; None, or what was wrong (frame
        count or sizes). A problem may leave the buffers partly written."""
        for i, buffer in enumerate(buffers):
            if not self._more:
                return f"{i} frames, expected {len(buffers)}"
            # Parts of a message are delivered together: once the first is here, all are.
            nbytes = self._socket.recv_into(buffer, flags=zmq.NOBLOCK)
            self._more = bool(self._socket.getsockopt(zmq.RCVMORE))
            if nbytes != buffer.nbytes:
                return f"frame {i} has {nbytes} bytes, expected {buffer.nbytes}"
        if self._more:
            return f"more than the {len(buffers)} frames expected"
        return None

    def discard_rest(self) -> None:
        """Drop the frames nobody read."""
        if self._more:
            _discard_frames(self._socket)
            self._more = False


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
        self._dropped = DroppedFrames(
            f"kv side channel ({backend} {side})",
            BAD_MESSAGES.labels(backend=backend, side=side).inc,
            logger,
        )

    @classmethod
    def bind(cls, host: str, port: int, backend: str, side: str, **kwargs) -> SideChannel:
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        cluster_auth.installed().server(socket, "kv")
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
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        cluster_auth.installed().client(socket)
        # A closed DEALER still flushes its last messages (a ReleasePages) in the background.
        socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, max(max_inbound_bytes, MAX_INBOUND_FRAME_BYTES))
        socket.connect(endpoint)
        return cls(socket, backend, side, routed=False, **kwargs)

    @property
    def endpoint(self) -> str:
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def receive(self) -> Iterator[Incoming]:
        """Every valid message waiting now (at most MAX_FRAMES_PER_TURN); never blocks.

        Handle each message before asking for the next: its frames are read (or dropped) in
        between. Stops when the socket is closed meanwhile.
        """
        for _ in range(MAX_FRAMES_PER_TURN):
            if self.socket.closed:
                return
            try:
                first = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            incoming = self._parse(first)
            if incoming is not None:
                yield incoming
                incoming.discard_rest()

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
            logger.warning("could not send %s: %s", type(msg).__name__, exc)
            return False
        return True

    def reject(self, why: str) -> None:
        """Count and log (rate-limited) a message dropped: malformed, or well-formed but making no
        sense in the current state."""
        self._dropped.drop(why)

    def close(self) -> None:
        self.socket.close()

    def _parse(self, first: zmq.Frame) -> Incoming | None:
        identity, head = None, first
        if self._routed:
            if not first.more:
                self.reject("empty message")
                return None
            identity, head = first.bytes, self.socket.recv(zmq.NOBLOCK, copy=False)
        try:
            msg = decode(head.buffer, self._max_message_bytes)
        except ProtocolError as exc:
            if head.more:
                _discard_frames(self.socket)
            self.reject(f"dropped a malformed message ({len(head)} bytes): {exc}")
            return None
        if head.more and not isinstance(msg, self._frames_allowed):
            stray = _discard_frames(self.socket)
            self.reject(f"dropped {type(msg).__name__} carrying {stray} stray frames")
            return None
        return Incoming(msg, identity, self.socket, head.more)


def _discard_frames(socket: zmq.Socket) -> int:
    """Drop the rest of the message being received; how many frames that was."""
    dropped = 0
    more = True
    while more and not socket.closed:
        socket.recv_into(bytearray(), flags=zmq.NOBLOCK)  # an empty buffer discards the frame
        more = bool(socket.getsockopt(zmq.RCVMORE))
        dropped += 1
    return dropped
