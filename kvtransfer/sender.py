"""The sender logic both backends share: leases, the handshake, and the side-channel dispatch.

A backend supplies how a fetch is served (ZMQ: page frames; NIXL: a go-ahead for a READ) and
how to tell whether a served fetch may still be reading the pages.

A transfer may be read by several receivers, each for some of the pages' KV heads (the ranks of
a tensor-parallel decode worker); the one ReleasePages of the group's rank 0 ends the lease.

A prefix fetch (``PrefixRequest``) is queued as it comes and answered from ``poll`` alone, on
the worker's main loop between steps, since the ``PrefixLender`` it asks reads and pins the
worker's page books: its loan becomes a lease like a publication's, whose pages are the loan's
buffers, and whose end gives the loan back instead of being returned by ``poll``.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from dataclasses import dataclass, field

from common.engine.kv_pool import KVPool
from common.messages import PROTOCOL_VERSION
from kvtransfer.base import KVSender, PrefixLender, PrefixLoan, TransferParams, check_page_ids
from kvtransfer.messages import (
    FetchRequest,
    HandshakeReply,
    HandshakeRequest,
    NixlAgentInfo,
    PrefixOffer,
    PrefixRequest,
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
    loan: PrefixLoan | None = None  # a prefix fetch's: its pages are the loan's ``rows``

    @property
    def num_pages(self) -> int:
        return len(self.loan.pages) if self.loan is not None else len(self.page_ids)


@dataclass(slots=True, eq=False)
class Lending:
    """A prefix fetch asked for, whose loan is not ready yet (its disk pages are being read)."""

    identity: bytes
    transfer_id: str
    loan: PrefixLoan
    expires: float  # time.monotonic()


class SideChannelSender(KVSender):
    def __init__(self, pool: KVPool, engine_id: str, host: str = "127.0.0.1", port: int = 0):
        if not engine_id:
            raise ValueError("a KV sender needs a non-empty engine_id")
        self.pool = pool
        self.engine_id = engine_id
        self.instance_id = uuid.uuid4().hex
        self._leases: dict[str, Lease] = {}
        self._released: list[str] = []
        self._lender: PrefixLender | None = None
        self._loan_seconds = 0.0  # how long a loan is kept from its request, at most
        self._prefix_asks: list[tuple[bytes, PrefixRequest]] = []  # for poll to answer
        self._lending: dict[str, Lending] = {}
        self._loans_over: list[PrefixLoan] = []  # for poll to end
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
        self._serve_prefixes()
        self._sweep()
        loans, self._loans_over = self._loans_over, []
        for loan in loans:
            loan.end()
        released, self._released = self._released, []
        return released

    def lend_prefixes(self, lender: PrefixLender, lease_seconds: float) -> None:
        if not self.serves_prefixes():
            super().lend_prefixes(lender, lease_seconds)  # raises
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        self._lender = lender
        self._loan_seconds = lease_seconds

    def lending(self) -> bool:
        return bool(self._lending)

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
        for lease in self._leases.values():
            if lease.loan is not None:
                lease.loan.end()
        for lending in self._lending.values():
            lending.loan.end()
        for loan in self._loans_over:
            loan.end()
        self._leases.clear()
        self._lending.clear()
        self._loans_over.clear()
        self._prefix_asks.clear()
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
            self._release_by_receiver(msg, identity)
        elif isinstance(msg, PrefixRequest):
            self._prefix_asks.append((identity, msg))  # the lender is asked from poll alone
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

    def _serve_prefixes(self) -> None:
        """Ask the lender for the prefix fetches that came, and offer each loan once ready."""
        asks, self._prefix_asks = self._prefix_asks, []
        for identity, msg in asks:
            self._lend(identity, msg)
        now = time.monotonic()
        for lending in list(self._lending.values()):
            if lending.loan.ready:
                del self._lending[lending.transfer_id]
                self._offer(lending)
            elif now >= lending.expires:
                del self._lending[lending.transfer_id]
                lending.loan.end()
                TRANSFER_FAILURES.labels(self.backend, SENDER, Failure.LEASE_EXPIRED).inc()
                self._channel.send(
                    TransferFailed(lending.transfer_id, "lease expired"), lending.identity
                )

    def _lend(self, identity: bytes, msg: PrefixRequest) -> None:
        transfer_id = msg.transfer_id
        if self._lender is None:
            reason = "this sender serves no prefix fetches"
        elif not transfer_id or transfer_id in self._leases or transfer_id in self._lending:
            reason = f"transfer {transfer_id!r} is already served"
        else:
            try:
                loan = self._lender.lend(msg.parent, msg.page_hashes, msg.token_ids)
            except ValueError as exc:
                reason = f"bad prefix request: {exc}"
            else:
                expires = time.monotonic() + self._loan_seconds
                self._lending[transfer_id] = Lending(identity, transfer_id, loan, expires)
                return
        self._channel.send(TransferFailed(transfer_id, reason), identity)

    def _offer(self, lending: Lending) -> None:
        """A ready loan: offer its pages and send them, or say none is held after all."""
        loan, transfer_id, identity = lending.loan, lending.transfer_id, lending.identity
        pages = loan.pages
        if not pages:
            loan.end()
            self._channel.send(TransferFailed(transfer_id, "none of the pages is held"), identity)
            return
        lease = Lease(transfer_id, [], lending.expires, loan=loan)
        lease.fetchers.add(identity)
        lease.fetch_started = time.monotonic()
        self._leases[transfer_id] = lease
        offer = PrefixOffer(transfer_id, self.instance_id, pages)
        if self._channel.send(offer, identity):
            self._serve(identity, lease, self.pool.layout.heads)

    def _release_by_receiver(self, msg: ReleasePages, identity: bytes) -> None:
        lending = self._lending.get(msg.transfer_id)
        if lending is not None:
            if lending.identity == identity:  # it gave up before its loan was ready
                del self._lending[msg.transfer_id]
                self._loans_over.append(lending.loan)
            return
        lease = self._leases.get(msg.transfer_id)
        if lease is None:
            return  # already released (lease over, or a repeated acknowledgement)
        if lease.loan is not None and identity not in lease.fetchers:
            # A loan is its receiver's alone: a release from another (an earlier receiver's,
            # flushed late to a sender now on its port) says nothing of it.
            return
        del self._leases[msg.transfer_id]
        if msg.ok and not lease.aborted:
            nbytes = lease.num_pages * self.pool.layout.bytes_per_page
            TRANSFER_BYTES.labels(self.backend, SENDER).inc(nbytes)
            TRANSFER_PAGES.labels(self.backend, SENDER).inc(lease.num_pages)
            if lease.fetch_started is not None:
                elapsed = time.monotonic() - lease.fetch_started
                TRANSFER_SECONDS.labels(self.backend, SENDER).observe(elapsed)
        elif not lease.aborted:
            TRANSFER_FAILURES.labels(self.backend, SENDER, Failure.RECEIVER_GAVE_UP).inc()
        self._end(lease)

    def _end(self, lease: Lease) -> None:
        """A lease is over: its loan goes back, or its id is reported by ``poll``."""
        if lease.loan is not None:
            self._loans_over.append(lease.loan)
        else:
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
                self._end(lease)
