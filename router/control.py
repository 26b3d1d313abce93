"""The control socket: a ZeroMQ ROUTER bound at ``--control`` that every worker's DEALER joins.

It runs on the app's event loop (a reader on the socket's FD; sends never wait), so a token
arriving from a worker reaches the HTTP handler waiting for it without crossing threads. Frames
that are not valid messages are logged, counted and dropped; nothing a peer sends can stop the
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import cast

import zmq

from common.cluster_auth import ClusterAuth
from common.dropped_frames import MAX_FRAMES_PER_TURN, DroppedFrames
from common.messages import Message, ProtocolError, decode, encode
from router.dispatcher import Dispatcher

logger = logging.getLogger(__name__)


def _has_input(sock: zmq.Socket) -> bool:
    # zmq.EVENTS is an int option; pyzmq types every option's value as int | bytes.
    return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)


class ControlServer:
    def __init__(self, endpoint: str, heartbeat_timeout: float, auth: ClusterAuth):
        self.endpoint = endpoint
        self.auth = auth
        self.heartbeat_timeout = heartbeat_timeout
        self.dispatcher: Dispatcher | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._tasks: list[asyncio.Task] = []

    def start(self, dispatcher: Dispatcher) -> None:
        """Bind and start receiving; call from the event loop that serves HTTP."""
        self.dispatcher = dispatcher
        self._dropped = DroppedFrames(
            "control socket", dispatcher.metrics.protocol_errors.inc, logger
        )
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self.auth.server(self._sock, "control")
        self._sock.setsockopt(zmq.LINGER, 0)
        # Refuse oversized frames in libzmq, before they are read into memory.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.bind(self.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._drain)
        self._schedule_drain()  # frames may have come before the reader was added
        self._tasks = [asyncio.create_task(self._expire_loop(), name="control-expire")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._sock.FD)
            self._sock.close(linger=0)
            self._sock = None
        self.auth.close()  # its threads hold sockets of the context
        if self._ctx is not None:
            self._ctx.term()

    def send(self, worker_id: str, msg: Message) -> None:
        if self._sock is None:
            return  # stopped
        try:
            self._sock.send_multipart([worker_id.encode(), encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # ROUTER drops frames to unknown peers; a full queue means the worker is not
            # reading, which its heartbeat timeout will settle.
            logger.warning("could not send %s to %s: %s", type(msg).__name__, worker_id, exc)
        # The socket's FD is edge-triggered and a send may consume the edge that frames
        # arriving meanwhile raised: look for them now rather than at the next frame.
        if _has_input(self._sock):
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            assert self._loop is not None
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Handle the frames waiting, up to a bound per turn so HTTP handlers get the loop back.

        Reading until ``zmq.Again`` re-arms the edge-triggered FD; stopping at the bound
        schedules another turn instead.
        """
        self._drain_scheduled = False
        if self._sock is None:
            return
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(frames)
        self._schedule_drain()

    def _handle(self, frames: list[bytes]) -> None:
        assert self.dispatcher is not None
        now = time.monotonic()
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected [identity, message], got {len(frames)} frames")
            sender = frames[0].decode("utf-8", errors="strict")
            self.dispatcher.on_message(sender, decode(frames[1]), now)
        except (ProtocolError, ValueError, UnicodeDecodeError) as exc:
            self._drop(frames, exc)
        except Exception:  # a router bug must not silence the control plane
            logger.exception("error handling a control message")

    async def _expire_loop(self) -> None:
        assert self.dispatcher is not None
        period = max(min(self.heartbeat_timeout / 4, 0.5), 0.01)
        while True:
            await asyncio.sleep(period)
            # Frames can sit unread with no edge left to announce them (an edge consumed by a
            # ZMQ call between two checks): then every worker's heartbeats would wait unread
            # until all of them expire. Look before judging anyone silent.
            if self._sock is not None and _has_input(self._sock):
                self._drain()
            try:
                self.dispatcher.expire(time.monotonic())
            except Exception:
                logger.exception("error expiring workers")

    def _drop(self, frames: list[bytes], exc: Exception) -> None:
        peer = frames[0][:64] if frames else b""
        self._dropped.drop(f"from {peer!r}: {exc}")
