"""The receiver logic both backends share: peers and their handshakes, deadlines, results.

A fetch moves through ``HANDSHAKE`` (waiting for its sender's handshake, done once per sender),
``REQUESTED`` (FetchRequest sent), ``READING`` (NIXL: a READ is posted) and, when a failed
fetch's READ cannot be cancelled at once, ``DRAINING`` (waiting for the READ to stop writing).
It ends with exactly one TransferResult. A backend supplies what happens between the request
and the pages being in place.

A fetch may bring only some of the pages' KV heads (``start_read``: a tensor-parallel rank's
share, from one rank of the prefill worker); such a read sends no ReleasePages at its end, as
the lease is its group's, which ``release`` ends once every rank holds its copy.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from dataclasses import dataclass, field

from common.engine.kv_pool import KVPool
from common.messages import PROTOCOL_VERSION
from common.protocol import PrefixSource
from kvtransfer.base import (
    LEASE_SAFETY_MARGIN_S,
    KVReceiver,
    TransferError,
    TransferParams,
    TransferResult,
    check_fetch,
    check_page_ids,
)
from kvtransfer.messages import (
    FetchReady,
    FetchRequest,
    HandshakeReply,
    HandshakeRequest,
    OfferedPage,
    PageData,
    PrefixOffer,
    PrefixRequest,
    ReleasePages,
    TransferFailed,
)
from kvtransfer.metrics import (
    RECEIVER,
    TRANSFER_BYTES,
    TRANSFER_FAILURES,
    TRANSFER_PAGES,
    TRANSFER_SECONDS,
    Failure,
)
from kvtransfer.side_channel import Incoming, SideChannel

logger = logging.getLogger(__name__)

HANDSHAKE = "handshake"
REQUESTED = "requested"
READING = "reading"
DRAINING = "draining"

# Largest control frame a receiver accepts from a sender (a NIXL handshake carries the agent's
# metadata, which grows with the registered memory).
MAX_REPLY_BYTES = 16 << 20


@dataclass(slots=True, eq=False)
class Peer:
    """One sender: its socket, and its handshake once it has answered."""

    engine_id: str
    endpoint: str
    channel: SideChannel
    reply: HandshakeReply | None = None
    remote: object | None = None  # the backend's handle on the sender (a NIXL agent name)
    fetches: dict[str, str] = field(default_factory=dict)  # sender's transfer id -> fetch id
    suspect: bool = False  # a fetch timed out: handshake afresh once this peer is idle


@dataclass(slots=True, eq=False)
class Fetch:
    transfer_id: str  # what this receiver's caller calls it (its TransferResult's id)
    params: TransferParams
    dst_page_ids: list[int]
    peer: Peer
    started: float  # time.monotonic()
    deadline: float  # time.monotonic()
    remote_id: str  # what the sender calls it
    heads: range  # the model's KV heads it brings (all of this pool's for a whole fetch)
    releases: bool  # whether its end sends ReleasePages (a read of a group's share does not)
    state: str = HANDSHAKE
    handle: object | None = None  # the backend's in-flight operation (a NIXL transfer)
    staging: object | None = None  # where the backend lands pages before they go in place
    pages_done: int = 0  # pages already in place (ZMQ answers arrive in several messages)
    failure: tuple[str, str] | None = None  # (error, reason) held while DRAINING
    prefix: PrefixRequest | None = None  # a prefix fetch's request (pages named by hash)
    offered: list[OfferedPage] | None = None  # a prefix fetch's offer, once it came


class SideChannelReceiver(KVReceiver):
    fetches_prefixes = False  # whether start_prefix_fetch works (the backend serves them)

    def __init__(self, pool: KVPool, engine_id: str):
        if not engine_id:
            raise ValueError("a KV receiver needs a non-empty engine_id")
        self.pool = pool
        self.engine_id = engine_id
        self._peers: dict[tuple[str, str], Peer] = {}
        self._fetches: dict[str, Fetch] = {}
        self._results: list[TransferResult] = []

    def start_fetch(
        self,
        transfer_id: str,
        params: TransferParams,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        self._start(transfer_id, transfer_id, params, self.pool.layout.heads, dst_page_ids, timeout)

    def start_prefix_fetch(
        self,
        transfer_id: str,
        source: PrefixSource,
        parent: int | None,
        page_hashes: list[int],
        token_ids: list[int],
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        if not self.fetches_prefixes:
            super().start_prefix_fetch(
                transfer_id, source, parent, page_hashes, token_ids, dst_page_ids, timeout
            )  # raises
        if len(dst_page_ids) != len(page_hashes) or not page_hashes:
            raise TransferError(
                f"{len(page_hashes)} page hashes but {len(dst_page_ids)} destination pages"
            )
        if len(token_ids) != len(page_hashes) * self.pool.layout.page_size:
            raise TransferError(f"{len(token_ids)} tokens for {len(page_hashes)} pages")
        # The sender picks which of its pages to lend: the params name no source page, and its
        # loan lasts at least as long as this fetch may.
        params = TransferParams(
            source.backend, source.endpoint, source.worker_id, [], time.time() + timeout + 1.0
        )
        request = PrefixRequest(transfer_id, parent, list(page_hashes), list(token_ids))
        self._start(
            transfer_id, transfer_id, params, self.pool.layout.heads, dst_page_ids, timeout,
            prefix=request,
        )  # fmt: skip

    def start_read(
        self,
        read_id: str,
        transfer_id: str,
        params: TransferParams,
        heads: range,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        """Like ``start_fetch``, for one rank's share of a group's transfer: fetch the model's
        KV heads ``heads`` of transfer ``transfer_id``'s pages from the sender ``params`` names
        into those heads of ``dst_page_ids``, reported by ``poll`` under ``read_id``. Its end
        sends no ReleasePages: the group's rank 0 ``release``s the transfer once every rank
        has its copy. Raises TransferError for heads this pool does not hold."""
        self._start(read_id, transfer_id, params, heads, dst_page_ids, timeout, releases=False)

    def release(self, params: TransferParams, transfer_id: str, ok: bool) -> None:
        """Tell the sender ``params`` names that its group's reads of ``transfer_id`` are over
        (``ok``: every rank holds its copy), so that it may free the pages."""
        if not self._peer_for(params).channel.send(ReleasePages(transfer_id, ok=ok)):
            logger.warning("could not release %s at %s", transfer_id, params.endpoint)

    def _start(
        self,
        transfer_id: str,
        remote_id: str,
        params: TransferParams,
        heads: range,
        dst_page_ids: list[int],
        timeout: float,
        releases: bool = True,
        prefix: PrefixRequest | None = None,
    ) -> None:
        if not transfer_id or not remote_id:
            raise TransferError("transfer_id must be non-empty")
        if transfer_id in self._fetches:
            raise TransferError(f"transfer {transfer_id!r} is already being fetched")
        problem = self.pool.layout.head_slice_problem(heads, "here")
        if problem is not None:
            raise TransferError(problem)
        if prefix is None:
            check_fetch(self.backend, params, dst_page_ids)
        elif params.backend != self.backend:
            raise TransferError(
                f"the prefix is held under the {params.backend!r} backend; this receiver is "
                f"{self.backend!r}"
            )
        if not timeout > 0:
            raise TransferError(f"timeout must be positive, got {timeout}")
        check_page_ids(dst_page_ids, self.pool.num_pages, "dst_page_ids")
        if prefix is None:
            check_page_ids(params.page_ids, None, "params.page_ids")  # checked at handshake
        now = time.monotonic()
        lease_left = params.lease_deadline - LEASE_SAFETY_MARGIN_S - time.time()
        peer = self._peer_for(params)
        if remote_id in peer.fetches:
            raise TransferError(f"transfer {remote_id!r} is already being read from this sender")
        fetch = Fetch(
            transfer_id,
            params,
            list(dst_page_ids),
            peer,
            started=now,
            deadline=now + min(timeout, lease_left),
            remote_id=remote_id,
            heads=heads,
            releases=releases,
            prefix=prefix,
        )
        self._fetches[transfer_id] = fetch
        peer.fetches[remote_id] = transfer_id
        if lease_left <= 0:
            self._fail(fetch, "the sender's lease was already over", Failure.LEASE_EXPIRED)
        elif peer.reply is not None:
            self._request(fetch)

    def poll(self) -> list[TransferResult]:
        self.serve_transfers()
        now = time.monotonic()
        for fetch in list(self._fetches.values()):
            if now >= fetch.deadline and fetch.state != DRAINING:
                waited = now - fetch.started
                self._fail(fetch, f"timed out after {waited:.2f}s ({fetch.state})", Failure.TIMEOUT)
        self._drop_idle_peers()
        results, self._results = self._results, []
        return results

    def serve_transfers(self) -> None:
        for peer in list(self._peers.values()):
            for incoming in peer.channel.receive():
                self._dispatch(peer, incoming)
        self._progress()

    def poll_sockets(self) -> list:
        return [peer.channel.socket for peer in self._peers.values()]

    def transfer_sockets(self) -> list:
        # Only senders with fetches in flight: an idle sender's socket (a late answer to an
        # ended fetch) can wait for poll, and a step with no fetches wakes no helper at all.
        return [peer.channel.socket for peer in self._peers.values() if peer.fetches]

    def abort(self, transfer_id: str) -> None:
        fetch = self._fetches.get(transfer_id)
        if fetch is not None and fetch.state != DRAINING:
            self._fail(fetch, "aborted", Failure.ABORTED)

    def close(self) -> None:
        for fetch in list(self._fetches.values()):
            if fetch.state != DRAINING and fetch.releases:
                fetch.peer.channel.send(ReleasePages(fetch.remote_id, ok=False))
            self._stop_writes(fetch)
        self._fetches.clear()
        self._results.clear()
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        self._close_backend()

    # --- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def _on_reply(self, fetch: Fetch, incoming: Incoming) -> None:
        """Handle a sender's answer to ``fetch``'s FetchRequest (other than TransferFailed)."""

    def _connect(self, peer: Peer, reply: HandshakeReply) -> str | None:
        """Set up the backend's link to a sender that passed the handshake; an error or None."""
        return None

    def _disconnect(self, peer: Peer) -> None:
        """Undo ``_connect``."""

    def _progress(self) -> None:
        """Backend work on every poll (e.g. checking posted READs)."""

    def _stop_writes(self, fetch: Fetch) -> bool:
        """Stop ``fetch`` writing its destination pages; False if it cannot stop yet."""
        return True

    def _close_backend(self) -> None:
        """Release the backend's resources."""

    def _max_inbound_bytes(self) -> int:
        return MAX_REPLY_BYTES

    # --- for backends --------------------------------------------------------------------

    def _complete(self, fetch: Fetch) -> None:
        """The pages are in place: acknowledge and report success."""
        self._end(fetch, ok=True, error=None, reason=None)

    def _fail(self, fetch: Fetch, error: str, reason: str) -> None:
        """End ``fetch`` as failed, once nothing writes its pages any more."""
        if fetch.state == DRAINING:
            return
        if not self._stop_writes(fetch):
            fetch.state = DRAINING
            fetch.failure = (error, reason)
            return
        self._end(fetch, ok=False, error=error, reason=reason)

    def _end_drained(self, fetch: Fetch) -> None:
        assert fetch.failure is not None
        error, reason = fetch.failure
        self._end(fetch, ok=False, error=error, reason=reason)

    def _rehandshake(self, peer: Peer) -> None:
        """The sender is not the one that answered the handshake (it restarted): redo it."""
        logger.info("sender %s at %s changed; handshaking again", peer.engine_id, peer.endpoint)
        self._disconnect(peer)
        peer.reply = None
        peer.remote = None
        for transfer_id in list(peer.fetches.values()):
            fetch = self._fetches[transfer_id]
            if fetch.state == REQUESTED and fetch.offered is not None:
                # What the restarted sender would lend is another offer: ask nothing of it.
                self._fail(fetch, "the sender restarted during a prefix fetch", Failure.TRANSPORT)
            elif fetch.state == REQUESTED:
                fetch.state = HANDSHAKE
                fetch.pages_done = 0
        self._send_handshake(peer)

    def _reject(self, peer: Peer, why: str) -> None:
        peer.channel.reject(why)

    # --- internals -----------------------------------------------------------------------

    def _peer_for(self, params: TransferParams) -> Peer:
        key = (params.engine_id, params.endpoint)
        peer = self._peers.get(key)
        if peer is None:
            channel = SideChannel.connect(
                params.endpoint,
                self.backend,
                RECEIVER,
                max_inbound_bytes=self._max_inbound_bytes(),
                max_message_bytes=MAX_REPLY_BYTES,
                frames_allowed=self._frames_allowed(),
            )
            peer = Peer(params.engine_id, params.endpoint, channel)
            self._peers[key] = peer
            self._send_handshake(peer)
        return peer

    def _frames_allowed(self) -> tuple[type, ...]:
        return ()

    def _send_handshake(self, peer: Peer) -> None:
        peer.channel.send(
            HandshakeRequest(
                protocol_version=PROTOCOL_VERSION,
                engine_id=self.engine_id,
                backend=self.backend,
                layout=self.pool.layout,
            )
        )

    def _dispatch(self, peer: Peer, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, HandshakeReply):
            if peer.reply is not None:
                self._reject(peer, "dropped a second handshake reply")
            else:
                self._on_handshake(peer, msg)
            return
        if not isinstance(msg, (TransferFailed, PageData, FetchReady, PrefixOffer)):
            self._reject(peer, f"a receiver does not take {type(msg).__name__}")
            return
        fetch = self._fetches.get(peer.fetches.get(msg.transfer_id, ""))
        if fetch is None or fetch.state not in (REQUESTED, READING):
            # A late answer to a fetch that has ended (timed out, aborted): nothing to do.
            logger.debug("dropped %s for inactive fetch %s", type(msg).__name__, msg.transfer_id)
            return
        if isinstance(msg, TransferFailed):
            self._fail(fetch, f"sender refused: {msg.reason}", Failure.SENDER_REFUSED)
        elif peer.reply is not None and msg.instance_id != peer.reply.instance_id:
            # The sender restarted since the handshake (its pool, even its layout, may differ):
            # handshake again; the fetch is asked for afresh once that is done.
            self._rehandshake(peer)
        elif isinstance(msg, PrefixOffer):
            self._on_offer(fetch, msg)
        elif fetch.prefix is not None and fetch.offered is None:
            self._reject(peer, "dropped page data that came before its prefix offer")
            self._fail(fetch, "page data before the prefix offer", Failure.TRANSPORT)
        else:
            self._on_reply(fetch, incoming)

    def _on_offer(self, fetch: Fetch, offer: PrefixOffer) -> None:
        """A prefix fetch's offer: the run of its pages the sender lends, which the page data
        that follows brings into the first destination pages."""
        asked = fetch.prefix
        if asked is None or fetch.offered is not None or fetch.state != REQUESTED:
            self._reject(fetch.peer, "dropped an unexpected prefix offer")
            return
        if not 0 < len(offer.pages) <= len(asked.page_hashes):
            self._reject(fetch.peer, f"dropped an offer of {len(offer.pages)} pages")
            self._fail(fetch, "malformed prefix offer", Failure.TRANSPORT)
            return
        fetch.offered = offer.pages
        fetch.dst_page_ids = fetch.dst_page_ids[: len(offer.pages)]

    def _on_handshake(self, peer: Peer, reply: HandshakeReply) -> None:
        problem = self._handshake_problem(peer, reply)
        if problem is None:
            problem = self._connect(peer, reply)
        if problem is not None:
            error = f"handshake with {peer.engine_id} at {peer.endpoint} refused: {problem}"
            logger.warning(error)
            for transfer_id in list(peer.fetches.values()):
                self._fail(self._fetches[transfer_id], error, Failure.HANDSHAKE)
            self._drop_peer(peer)
            return
        peer.reply = reply
        for transfer_id in list(peer.fetches.values()):
            fetch = self._fetches[transfer_id]
            if fetch.state == HANDSHAKE:
                self._request(fetch)

    def _handshake_problem(self, peer: Peer, reply: HandshakeReply) -> str | None:
        if reply.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version mismatch: {PROTOCOL_VERSION} here vs "
                f"{reply.protocol_version} there"
            )
        if reply.backend != self.backend:
            return f"backend mismatch: {self.backend!r} here vs {reply.backend!r} there"
        if reply.engine_id != peer.engine_id:
            return f"the endpoint serves engine {reply.engine_id!r}, not {peer.engine_id!r}"
        mismatch = self.pool.layout.mismatch(reply.layout)
        if mismatch is not None:
            return f"KV layout mismatch: {mismatch}"
        return None

    def _request(self, fetch: Fetch) -> None:
        reply = fetch.peer.reply
        assert reply is not None
        beyond = [b for b in fetch.params.page_ids if b >= reply.num_pages]
        heads_problem = reply.layout.head_slice_problem(fetch.heads, "there")
        if beyond:
            self._fail(
                fetch,
                f"source pages {beyond[:8]} outside the sender's pool of {reply.num_pages}",
                Failure.HANDSHAKE,
            )
        elif heads_problem is not None:
            self._fail(fetch, f"KV layout mismatch: {heads_problem}", Failure.HANDSHAKE)
        elif fetch.peer.channel.send(self._fetch_request(fetch, reply)):
            fetch.state = REQUESTED
        else:
            self._fail(fetch, "could not send the fetch request", Failure.TRANSPORT)

    def _fetch_request(self, fetch: Fetch, reply: HandshakeReply) -> FetchRequest | PrefixRequest:
        """Names the heads only where they are not every head the sender holds: a fetch
        between whole pools asks as it always has."""
        if fetch.prefix is not None:
            return fetch.prefix
        if fetch.heads == reply.layout.heads:
            return FetchRequest(fetch.remote_id)
        return FetchRequest(fetch.remote_id, fetch.heads.start, len(fetch.heads))

    def _end(self, fetch: Fetch, ok: bool, error: str | None, reason: str | None) -> None:
        del self._fetches[fetch.transfer_id]
        peer = fetch.peer
        peer.fetches.pop(fetch.remote_id, None)
        if fetch.releases:
            # Acknowledges a success; after a failure, lets the sender free its pages early.
            peer.channel.send(ReleasePages(fetch.remote_id, ok=ok))
        elapsed = time.monotonic() - fetch.started
        page_nbytes, scale_nbytes = self.pool.layout.slice_nbytes(len(fetch.heads))
        nbytes = len(fetch.dst_page_ids) * (page_nbytes + scale_nbytes) if ok else 0
        if ok:
            TRANSFER_BYTES.labels(self.backend, RECEIVER).inc(nbytes)
            TRANSFER_PAGES.labels(self.backend, RECEIVER).inc(len(fetch.dst_page_ids))
            TRANSFER_SECONDS.labels(self.backend, RECEIVER).observe(elapsed)
        else:
            assert reason is not None
            TRANSFER_FAILURES.labels(self.backend, RECEIVER, reason).inc()
            if reason in (Failure.TIMEOUT, Failure.TRANSPORT):
                peer.suspect = True
        offered = tuple(fetch.offered) if ok and fetch.offered is not None else ()
        self._results.append(
            TransferResult(
                fetch.transfer_id, ok, error, len(fetch.dst_page_ids), nbytes, elapsed, offered
            )
        )

    def _drop_idle_peers(self) -> None:
        for peer in list(self._peers.values()):
            if not peer.fetches and (peer.suspect or peer.reply is None):
                self._drop_peer(peer)

    def _drop_peer(self, peer: Peer) -> None:
        self._peers.pop((peer.engine_id, peer.endpoint), None)
        if peer.reply is not None:
            self._disconnect(peer)
        peer.channel.close()
