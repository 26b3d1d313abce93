"""The control socket: a ZeroMQ ROUTER bound at ``--control`` that every worker's DEALER joins.

It runs on the app's event loop (``zmq.asyncio``), so a token arriving from a worker reaches the
HTTP handler waiting for it without crossing threads. Frames that are not valid messages are
logged, counted and dropped; nothing a peer sends can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from common.messages import Message, ProtocolError, decode, encode
from router.dispatcher import Dispatcher

logger = logging.getLogger(__name__)

# Logged dropped frames are rate-limited: a peer spraying garbage must not flood the log.
_LOG_EVERY = 100


class ControlServer:
    def __init__(self, endpoint: str, heartbeat_timeout: float):
        self.endpoint = endpoint
        self.heartbeat_timeout = heartbeat_timeout
        self.dispatcher: Dispatcher | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._dropped = 0

    def start(self, dispatcher: Dispatcher) -> None:
        """Bind and start receiving; call from the event loop that serves HTTP."""
        self.dispatcher = dispatcher
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Refuse oversized frames in libzmq, before they are read into memory.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.bind(self.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="control-receive"),
            asyncio.create_task(self._expire_loop(), name="control-expire"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def send(self, worker_id: str, msg: Message) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([worker_id.encode(), encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # ROUTER drops frames to unknown peers; a full queue means the worker is not
            # reading, which its heartbeat timeout will settle.
            logger.warning("could not send %s to %s: %s", type(msg).__name__, worker_id, exc)

    async def _receive_loop(self) -> None:
        assert self._sock is not None and self.dispatcher is not None
        while True:
            frames = await self._sock.recv_multipart(copy=True)
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
            try:
                self.dispatcher.expire(time.monotonic())
            except Exception:
                logger.exception("error expiring workers")

    def _drop(self, frames: list[bytes], exc: Exception) -> None:
        assert self.dispatcher is not None
        self.dispatcher.metrics.protocol_errors.inc()
        self._dropped += 1
        if self._dropped % _LOG_EVERY == 1:
            peer = frames[0][:64] if frames else b""
            logger.warning(
                "dropped a control frame from %r (%d dropped so far): %s", peer, self._dropped, exc
            )
