"""A worker's connection to the router's control socket (a DEALER named by the worker id)."""

from __future__ import annotations

import logging
import time

import zmq

from common.cluster_auth import ClusterAuth
from common.dropped_frames import MAX_FRAMES_PER_TURN, DroppedFrames
from common.messages import Message, ProtocolError, decode, encode
from common.metrics import BAD_MESSAGES
from common.protocol import RegisterAck, RegisterWorker

logger = logging.getLogger(__name__)

# Messages to the router wait in ZMQ's queue while it restarts; past this many, sending blocks
# nobody but drops the newest (token deltas for a router that is gone are of no use).
_SEND_HWM = 100_000


class RouterUnavailable(RuntimeError):
    """The router did not accept the registration in time."""


class RouterLink:
    def __init__(
        self, context: zmq.Context, router_address: str, worker_id: str, auth: ClusterAuth
    ) -> None:
        self.worker_id = worker_id
        self.socket = context.socket(zmq.DEALER)
        auth.client(self.socket)
        self.socket.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self.socket.connect(router_address)
        self.router_address = router_address
        self.heartbeat_interval = 1.0
        # Messages that may wait for the next step's forward to be encoded and sent (see
        # send_soon). Whichever thread holds the link (StepIO: the main loop outside a step,
        # its helper inside one) sends them, before anything else, so the router reads every
        # message in the order the worker produced it.
        self._deferred: list[Message] = []
        # Read with the RegisterAck but after it: the router's first messages to the worker
        # registered (requests it dispatched at once), which the loop's next receive returns.
        self._after_ack: list[Message] = []
        self._dropped = DroppedFrames(
            "router link", BAD_MESSAGES.labels(socket="router").inc, logger
        )

    def register(self, registration: RegisterWorker, timeout: float) -> None:
        """Register and wait for the router's acknowledgement, re-sending every second (the
        router may still be starting). Raises ``RouterUnavailable`` or, when the router refuses
        this worker, ``ValueError`` with its reason."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(registration)
            if self.socket.poll(1000):
                messages = self.receive()
                for index, msg in enumerate(messages):
                    if isinstance(msg, RegisterAck):
                        if not msg.accepted:
                            raise ValueError(f"the router refused this worker: {msg.reason}")
                        self.heartbeat_interval = msg.heartbeat_interval
                        self._after_ack = messages[index + 1 :]
                        return
                    logger.warning("ignoring %s before registration", type(msg).__name__)
        raise RouterUnavailable(
            f"no router answered at {self.router_address} in {timeout:.0f} s (is it running, "
            "and does this worker hold the same cluster secret?)"
        )

    def send(self, msg: Message) -> None:
        self.flush()
        self._send_now(msg)

    def send_soon(self, msg: Message) -> None:
        """Queue ``msg`` to go out with the link's next send or flush: a step's token deltas
        are encoded and sent by the step helper while the next step's forward runs, not
        between the two steps, where the device would wait for them."""
        self._deferred.append(msg)

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def flush(self) -> None:
        """Send every queued message, oldest first."""
        while self._deferred:
            deferred, self._deferred = self._deferred, []
            for msg in deferred:
                self._send_now(msg)

    def _send_now(self, msg: Message) -> None:
        try:
            self.socket.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("router queue full; dropped %s", type(msg).__name__)

    def receive(self) -> list[Message]:
        """The messages waiting on the socket, at most ``MAX_FRAMES_PER_TURN`` (the rest wait for
        the next turn); malformed frames are counted and dropped."""
        messages, self._after_ack = self._after_ack, []
        # Asked before each read: an empty socket's zmq.Again costs an exception every turn.
        for _ in range(MAX_FRAMES_PER_TURN):
            if not self.socket.poll(0):
                break
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            if len(frames) != 1:
                self._drop(f"{len(frames)} frames instead of 1")
                continue
            try:
                messages.append(decode(frames[0]))
            except ProtocolError as exc:
                self._drop(str(exc))
        return messages

    def has_input(self) -> bool:
        """Whether ``receive`` has messages to return without waiting on the socket."""
        return bool(self._after_ack)

    def close(self) -> None:
        self.flush()
        self.socket.close(linger=0)

    def _drop(self, reason: str) -> None:
        self._dropped.drop(reason)
