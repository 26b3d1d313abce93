"""The KV-transfer contract: a sender on the prefill side and a receiver on the decode side.

Pages move as transfers, each named by a transfer id (``tid``) that the prefill worker picks:
the request id for a prompt's pages handed off at once, ``<request id>/part<N>`` for the pages
of a prompt shipped while it is still being prefilled (``common/protocol.py``'s HandoffPart).
One transfer's pages move like this::

    prefill worker                                  decode worker
    params = sender.publish(tid, pages, lease)
    ... params travel in the handoff ...  ───────▶  receiver.start_fetch(tid, params, dst, timeout)
    sender.poll()  (serves handshakes, fetches)     receiver.poll() -> [TransferResult(tid, ok)]
    sender.poll() -> [tid]: free the pages    ◀────  (the receiver acknowledged, or gave up)

Both sides are driven by their worker's main loop: neither ever pages, and neither starts a
thread (ZeroMQ's I/O thread and UCX's event thread sleep while there is no traffic). Every
transfer ends, whatever happens: the receiver's fetch has a deadline (its timeout, and never
later than the sender's lease), and the sender's lease has a deadline after which its pages are
released even if no receiver ever came. Either side may abort.

Neither side allocates or frees pages: the sender's caller keeps its pages allocated until
``KVSender.poll`` returns the transfer id, and the receiver's caller keeps the destination pages
reserved until ``KVReceiver.poll`` returns the transfer's result.

A prefix fetch (ZMQ only) goes the other way round: the receiver names pages by their hashes,
and the sender's owner lends what it holds of them, wherever they are, through a
``PrefixLender`` it gave the sender::

    sender.lend_prefixes(lender, lease)             receiver.start_prefix_fetch(tid, source,
                                                        parent, hashes, tokens, dst, timeout)
    sender.poll(): lender.lend(...) -> PrefixLoan ◀────  (PrefixRequest)
    ... loan.ready: offer its pages, send them ───────▶  receiver.poll() -> [TransferResult
    sender.poll(): loan.end()                    ◀────       (tid, ok, offered pages)]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from common.protocol import PrefixSource, TransferParams
from kvtransfer.messages import OfferedPage

__all__ = [
    "KVReceiver",
    "KVSender",
    "OfferedPage",
    "PrefixLender",
    "PrefixLoan",
    "TransferError",
    "TransferParams",
    "TransferResult",
]

# A receiver treats a lease as over this long before its deadline, so that a page read just as
# the sender frees it is never reported good (covers polling granularity and clock skew).
LEASE_SAFETY_MARGIN_S = 0.25


class TransferError(ValueError):
    """A transfer request that can never succeed (bad page ids, wrong backend, ...)."""


def check_page_ids(page_ids: list[int], num_pages: int | None, what: str) -> None:
    """Raise TransferError unless ``page_ids`` are distinct pages of a pool of ``num_pages``
    (None: of a pool whose size is not known here)."""
    if not page_ids:
        raise TransferError(f"{what} must not be empty")
    for page_id in page_ids:
        if not isinstance(page_id, int) or isinstance(page_id, bool):
            raise TransferError(f"{what} must be ints, got {page_id!r}")
        if page_id < 0 or (num_pages is not None and page_id >= num_pages):
            raise TransferError(f"{what} holds page {page_id} outside a pool of {num_pages}")
    if len(set(page_ids)) != len(page_ids):
        raise TransferError(f"{what} repeats a page")


def check_fetch(backend: str, params: TransferParams, dst_page_ids: list[int]) -> None:
    """Raise TransferError unless ``params`` are for ``backend`` and offer as many pages as
    ``dst_page_ids`` holds."""
    if params.backend != backend:
        raise TransferError(
            f"params are for the {params.backend!r} backend; this receiver is {backend!r}"
        )
    if len(dst_page_ids) != len(params.page_ids):
        raise TransferError(
            f"{len(params.page_ids)} source pages but {len(dst_page_ids)} destination pages"
        )


@dataclass(slots=True, frozen=True)
class TransferResult:
    """How one fetch ended; ``error`` says why when ``ok`` is false."""

    transfer_id: str
    ok: bool
    error: str | None
    num_pages: int
    nbytes: int  # bytes moved (scales included); 0 for a failed fetch
    seconds: float  # from start_fetch to the end
    # A prefix fetch's pages as the sender offered them (``num_pages`` of them, the first
    # destination pages, on success); empty for any other fetch.
    offered: tuple[OfferedPage, ...] = ()


class PrefixLoan(ABC):
    """Pages of a prompt's prefix that a sender's owner lends for one prefix fetch: pinned where
    they are until ``end``. Made by ``PrefixLender.lend``; the sender only reads it."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Whether ``pages`` and ``rows`` may be read (a page read from disk lands later)."""

    @property
    @abstractmethod
    def pages(self) -> list[OfferedPage]:
        """The run of pages lent, from the first one asked for; empty: none after all."""

    @abstractmethod
    def rows(self) -> list[list]:
        """The lent pages' bytes: per tensor of the pool (data, then any scales), one buffer per
        page of ``pages``, each readable until ``end``."""

    @abstractmethod
    def end(self) -> None:
        """The fetch is over: unpin the pages (no buffer of ``rows`` is read after this)."""


class PrefixLender(ABC):
    """What a sender's owner gives it to serve prefix fetches (the prefill worker's page books
    and KV tiers). Called only from ``KVSender.poll``, on the owner's main loop, between its
    steps: never while a step may change the pages."""

    @abstractmethod
    def lend(self, parent: int | None, page_hashes: list[int], token_ids: list[int]) -> PrefixLoan:
        """Pin the leading run of ``page_hashes`` held here whose tokens are ``token_ids``
        (``page_size`` per page; ``parent``: the hash of the page before the first, None for a
        prompt's first page), confirmed as the prefix cache confirms a hit. Raises ValueError
        for a request that makes no sense."""


class KVSender(ABC):
    """Prefill side: offers pages to receivers over a side channel and reports when to free them.

    Constructed as ``Sender(pool, engine_id, host="127.0.0.1", port=0)``: binds the side channel
    on ``host:port`` (0: any free port; ``host`` is advertised as is, so it must be an address
    receivers can reach) and registers the pool. Owned and called by one thread at a time:
    the prefill worker's main loop, which hands it to a helper thread for ``serve_requests``
    while it runs a step (``common/service/step_io.py``) and calls nothing else meanwhile. It
    never blocks and never writes to the pool; it only reads the pages it has published.
    """

    backend: str  # the registry name, copied into every TransferParams

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The side channel's address, ``tcp://HOST:PORT``, as receivers must dial it."""

    @abstractmethod
    def publish(
        self, transfer_id: str, page_ids: list[int], lease_seconds: float
    ) -> TransferParams:
        """Offer ``page_ids`` (context order) under a lease; return what the receiver needs.

        Called by the worker once a request's pages are final. Pins nothing: the caller keeps the
        pages allocated and unmodified until ``poll`` returns ``transfer_id``. Raises ValueError
        for a page outside the pool, a repeated page, a non-positive lease or a transfer id that
        is already published.
        """

    @abstractmethod
    def poll(self) -> list[str]:
        """Serve pending side-channel traffic without blocking; return ids whose pages are free.

        Called every iteration of the worker's loop (and often while idle): handshakes, fetches
        and acknowledgements are only served from here. A published id is returned exactly once:
        when the receiver has acknowledged (or given up on) the pages, when its lease ends, or
        after ``abort``, once no transfer can still be reading the pages.
        """

    @abstractmethod
    def serve_requests(self) -> None:
        """The part of ``poll`` that answers receivers (handshakes, fetches, acknowledgements),
        without blocking and without handing back freed ids, which ``poll`` still returns.

        Lets a receiver's fetch be answered while the worker's main loop is busy in a long
        step, instead of only after it: see the class docstring for who may call it when.
        """

    @abstractmethod
    def poll_sockets(self) -> list:
        """The ZMQ sockets on which traffic for this sender arrives.

        For a worker that waits in a ``zmq.Poller`` while idle: adding these wakes it when a
        receiver calls, instead of only at its next timeout. Reading them stays ``poll``'s job.
        """

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Withdraw a publication (client gone, request cancelled).

        A receiver that has not started reading is refused; one that is reading is told to fail.
        ``poll`` returns the id once nothing reads the pages any more. Unknown ids are ignored.
        """

    def serves_prefixes(self) -> bool:
        """Whether ``lend_prefixes`` may be called: this backend serves prefix fetches."""
        return False

    def lend_prefixes(self, lender: PrefixLender, lease_seconds: float) -> None:
        """Serve prefix fetches from what ``lender`` lends (see the module docstring); a loan is
        kept at most ``lease_seconds`` from its request, as a publication's lease."""
        raise TransferError(f"the {self.backend} backend serves no prefix fetches")

    def lending(self) -> bool:
        """Whether a prefix loan is waiting to be ready (a disk read), which no socket will
        announce: the worker should call ``poll`` again soon rather than sleep."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Close the side channel and unregister the pool; every publication is dropped."""


class KVReceiver(ABC):
    """Decode side: fetches published pages into this worker's pool.

    Constructed as ``Receiver(pool, engine_id)``: registers the pool for incoming pages;
    ``engine_id`` names this worker to senders. Owned and called by the decode worker's main
    loop, and, while that loop is inside a step, by its step helper (``serve_transfers`` only):
    never by both at once. It never blocks. It writes only to the destination pages of fetches
    in progress, which no step reads.
    """

    backend: str  # the registry name; start_fetch refuses params of another backend

    @abstractmethod
    def start_fetch(
        self,
        transfer_id: str,
        params: TransferParams,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        """Begin fetching ``params.page_ids`` into ``dst_page_ids`` (same order, same length).

        Called when a handoff arrives, with the destination pages already reserved. Raises
        TransferError at once for input that can never work (length mismatch, other backend,
        a page outside the pool, a repeated page, an id already in flight). Everything else,
        including a failed handshake (protocol version or KV layout differ) is reported by
        ``poll``. The first fetch from a sender performs the handshake; later ones reuse it.
        The fetch's deadline is ``timeout`` seconds from now, or the lease's end if sooner.
        """

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
        """Begin fetching the pages of a prompt's prefix that ``source`` holds, by their page
        hashes (``parent``: the hash of the page before the first, None for the prompt's first
        page; ``token_ids``: the prompt's tokens of those pages), into ``dst_page_ids`` (one
        per hash). The sender offers the leading run it holds; the result's ``offered`` says
        which pages, in the first destination pages, and its ``num_pages`` how many. The caller
        checks them (hashes, parents, tokens) before using them. Raises TransferError as
        ``start_fetch`` does, and where this receiver fetches no prefixes (another backend, a
        tensor-parallel group)."""
        raise TransferError(f"the {self.backend} backend fetches no prefixes")

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Make progress without blocking; return the fetches that ended since the last call.

        Each started fetch yields exactly one result. When it does, nothing writes to its
        destination pages any more, and the sender has been told to release its pages. On
        success the pages hold exactly the sender's bytes.
        """

    @abstractmethod
    def poll_sockets(self) -> list:
        """The ZMQ sockets on which traffic for fetches in progress arrives (one per sender).

        Like ``KVSender.poll_sockets``; the list changes as senders come and go, so ask again
        before each wait.
        """

    @abstractmethod
    def serve_transfers(self) -> None:
        """The part of ``poll`` that moves pages: read what senders sent, put pages in place,
        answer them, keeping the fetches that end for ``poll`` to return. Called by the decode
        worker's step helper while a step runs, when ``transfer_sockets`` have traffic, so a
        prompt's pages land beside the forward instead of between two steps."""

    def transfer_sockets(self) -> list:
        """The sockets whose traffic ``serve_transfers`` reads, all of it: asked afresh at each
        step's start and after each serve (none: nothing to serve)."""
        return []

    def progressing_silently(self) -> bool:
        """Whether a fetch is moving without traffic on ``poll_sockets`` (a NIXL READ carried
        out by UCX threads): a worker should then call ``poll`` again soon instead of sleeping
        on the sockets until its idle timeout."""
        return False

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Stop fetching; the sender is told to release. Unknown ids are ignored.

        ``poll`` then reports the fetch as failed (error "aborted") once nothing writes to its
        destination pages any more; only then may they be reused.
        """

    @abstractmethod
    def close(self) -> None:
        """Drop every fetch (telling senders to release) and free sockets and registrations."""
