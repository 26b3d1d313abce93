"""The sender logic both backends share: leases, the handshake, and the side-channel dispatch.

A backend supplies how a fetch is served (ZMQ: page frames; NIXL: a go-ahead for a READ) and
how to tell whether a served fetch may still be reading the pages.

A transfer may be read by several receivers, each for some of the pages' KV heads (the ranks of
a tensor-parallel decode worker); the one ReleasePages of the group's rank 0 ends the lease.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from dataclasses import dataclass, field

from common.engine.kv_pool import KVPool
from common.messages import PROTOCOL_VERSION
from kvtransfer.base import KVSender, TransferParams, check_page_ids
from kvtransfer.messages import (
    FetchRequest,
    HandshakeReply,
    HandshakeRequest,
    NixlAgentInfo,
    ReleasePages,
    TransferFailed,
)
from kvtransfer.metrics import (
    SENDER,
    TRANSFER_BYTES,
    TRANSFER_FAILURES,
    TRANSFER_PAGES,
    TRANSFER_SECONDS,
    Failure,
)
from kvtransfer.side_channel import Incoming, SideChannel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    """One published transfer: its pages stay untouched by the worker until it is released."""

    transfer_id: str
    page_ids: list[int]
    expires: float  # time.monotonic()
    fetchers: set[bytes] = field(default_factory=set)  # routing ids of the receivers served
    fetch_started: float | None = None  # time.monotonic() of the first fetch served
    aborted: bool = False
    in_flight: object | None = None  # backend's handle on a served fetch (e.g. a ZMQ tracker)


class SideChannelSender(KVSender):
    def __init__(self, pool: KVPool, engine_id: str, host: str = "127.0.0.1", port: int = 0):
        if not engine_id:
            raise ValueError("a KV sender needs a non-empty engine_id")
        self.pool = pool
        self.engine_id = engine_id
        self.instance_id = uuid.uuid4().hex
        self._leases: dict[str, Lease] = {}
        self._released: list[str] = []
        self._channel = SideChannel.bind(host, port, self.backend, SENDER)
        self._endpoint = self._channel.endpoint

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def publish(
        self, transfer_id: str, page_ids: list[int], lease_seconds: float
    ) -> TransferParams:
        if not transfer_id:
            raise ValueError("transfer_id must be non-empty")
        if transfer_id in self._leases:
            raise ValueError(f"transfer {transfer_id!r} is already published")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        check_page_ids(page_ids, self.pool.num_pages, "page_ids")
        page_ids = list(page_ids)
        self._leases[transfer_id] = Lease(transfer_id, page_ids, time.monotonic() + lease_seconds)
        return TransferParams(
            backend=self.backend,
            endpoint=self._endpoint,
            engine_id=self.engine_id,
            page_ids=page_ids,
            lease_deadline=time.time() + lease_seconds,
        )

    def poll(self) -> list[str]:
        self.serve_requests()
        self._sweep()
        released, self._released = self._released, []
        return released

    def serve_requests(self) -> None:
        for incoming in self._channel.receive():
            self._dispatch(incoming)
        self._progress()

    def poll_sockets(self) -> list:
        return [self._channel.socket]

    def abort(self, transfer_id: str) -> None:
        lease = self._leases.get(transfer_id)
        if lease is None or lease.aborted:
            return
        lease.aborted = True
        TRANSFER_FAILURES.labels(self.backend, SENDER, Failure.ABORTED).inc()
        for fetcher in lease.fetchers:
            self._channel.send(TransferFailed(transfer_id, "aborted by the sender"), fetcher)

    def end_lease(self, transfer_id: str) -> None:
        """Forget a publication at once, without reporting it from ``poll``: for a rank of a
        tensor-parallel prefill worker, whose rank 0 owns the pages and has seen the group's
        release (nothing reads them any more). Unknown ids are ignored."""
        self._leases.pop(transfer_id, None)

    def close(self) -> None:
        self._leases.clear()
        self._channel.close()
        self._close_backend()

    # --- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def _serve(self, identity: bytes, lease: Lease, heads: range) -> None:
        """Answer a fetch of ``lease``'s pages, the model's KV heads ``heads`` of them (this
        pool holds them); may set ``lease.in_flight``."""

    @abstractmethod
    def _still_reading(self, lease: Lease) -> bool:
        """Whether a served fetch may still read the pages (so an abort must wait)."""

    def _nixl_info(self) -> NixlAgentInfo | None:
        return None

    def _progress(self) -> None:
        """Backend work to do on every poll."""

    def _close_backend(self) -> None:
        """Release the backend's resources."""

    # --- internals -----------------------------------------------------------------------

    def _dispatch(self, incoming: Incoming) -> None:
        msg, identity = incoming.msg, incoming.identity
        assert identity is not None
        if isinstance(msg, HandshakeRequest):
            self._handshake(identity, msg)
        elif isinstance(msg, FetchRequest):
            self._fetch(identity, msg)
        elif isinstance(msg, ReleasePages):
            self._release_by_receiver(msg)
        else:
            self._channel.reject(f"a sender does not take {type(msg).__name__}")

    def _handshake(self, identity: bytes, msg: HandshakeRequest) -> None:
        if msg.protocol_version != PROTOCOL_VERSION or msg.backend != self.backend:
            # The receiver makes the decision and reports it; this side only leaves a trace.
            logger.warning(
                "receiver %s speaks protocol %d over %s; this sender speaks %d over %s",
                msg.engine_id,
                msg.protocol_version,
                msg.backend,
                PROTOCOL_VERSION,
                self.backend,
            )
        reply = HandshakeReply(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.engine_id,
            instance_id=self.instance_id,
            backend=self.backend,
            layout=self.pool.layout,
            num_pages=self.pool.num_pages,
            nixl=self._nixl_info(),
        )
        self._channel.send(reply, identity)

    def _fetch(self, identity: bytes, msg: FetchRequest) -> None:
        transfer_id = msg.transfer_id
        lease = self._leases.get(transfer_id)
        heads, heads_problem = self._heads_asked(msg)
        if heads_problem is not None:
            reason = heads_problem
        elif lease is None:
            reason = "unknown transfer (never published, expired or released)"
        elif lease.aborted:
            reason = "aborted by the sender"
        elif time.monotonic() >= lease.expires:
            reason = "lease expired"
        else:
            lease.fetchers.add(identity)
            if lease.fetch_started is None:
                lease.fetch_started = time.monotonic()
            self._serve(identity, lease, heads)
            return
        self._channel.send(TransferFailed(transfer_id, reason), identity)

    def _heads_asked(self, msg: FetchRequest) -> tuple[range, str | None]:
        """The model KV heads ``msg`` asks for (every one held, unless it names some), and
        why they cannot be served or None."""
        held = self.pool.layout.heads
        if msg.first_kv_head is None and msg.num_kv_heads is None:
            return held, None
        if msg.first_kv_head is None or msg.num_kv_heads is None:
            return held, "a fetch must name both its first KV head and their number"
        heads = range(msg.first_kv_head, msg.first_kv_head + msg.num_kv_heads)
        return heads, self.pool.layout.head_slice_problem(heads, "there")

    def _release_by_receiver(self, msg: ReleasePages) -> None:
        lease = self._leases.pop(msg.transfer_id, None)
        if lease is None:
            return  # already released (lease over, or a repeated acknowledgement)
        if msg.ok and not lease.aborted:
            nbytes = len(lease.page_ids) * self.pool.layout.bytes_per_page
            TRANSFER_BYTES.labels(self.backend, SENDER).inc(nbytes)
            TRANSFER_PAGES.labels(self.backend, SENDER).inc(len(lease.page_ids))
            if lease.fetch_started is not None:
                elapsed = time.monotonic() - lease.fetch_started
                TRANSFER_SECONDS.labels(self.backend, SENDER).observe(elapsed)
        elif not lease.aborted:
            TRANSFER_FAILURES.labels(self.backend, SENDER, Failure.RECEIVER_GAVE_UP).inc()
        self._released.append(lease.transfer_id)

    def _sweep(self) -> None:
        """Release leases that are over, and aborted ones that nothing reads any more."""
        now = time.monotonic()
        for lease in list(self._leases.values()):
            expired = now >= lease.expires
            if expired or (lease.aborted and not self._still_reading(lease)):
                if expired and not lease.aborted:
                    TRANSFER_FAILURES.labels(self.backend, SENDER, Failure.LEASE_EXPIRED).inc()
                del self._leases[lease.transfer_id]
                self._released.append(lease.transfer_id)
