"""A prompt prefilled here whose leading pages a prefill worker holds: fetched, not computed.

The router sends a prompt whose uncached part is short straight to a decode worker; where a
prefill worker holds the prompt's leading pages (in its pool or the KV tiers below it), the
``DecodeRequest`` names it (``PrefixSource``). Before the prompt joins the queue, this worker
fetches those pages by their hashes (``KVReceiver.start_prefix_fetch``)::

    DecodeRequest(prefix) ──reserve, fetch──▶ FETCHING ──result──▶ pages checked, filed ──▶ admitted
                                                  └──discarded (abort, re-dispatch)──▶ pages freed

- Only the pages this worker's own prefix cache lacks are asked for, and never the page of the
  prompt's last token (it is computed to sample the first token).
- Each page that comes is checked as the prefix cache and the tiers check a hit: its hash, its
  parent's hash and its token ids must be the prompt's. The run ends at the first that is not:
  a page that does not check is a miss, never a wrong token.
- The pages that check are filed in the prefix cache and the reservation is given back; the
  sequence is then admitted as any other, and admission's prefix match takes them as computed
  (pages that the pool needed meanwhile are simply computed).
- Any failure (no room, the pages gone, a timeout, the prefill worker gone, another backend)
  admits the prompt to be computed whole: never a lost or failed request.

Called by the decode worker's main loop alone, between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.page_manager import PageManager
from common.engine.sequence import Sequence
from common.hashing import page_hashes
from common.metrics import (
    KV_PREFIX_BYTES_FETCHED,
    KV_PREFIX_FETCH_FALLBACKS,
    KV_PREFIX_PAGES_FETCHED,
)
from common.protocol import PrefixSource
from decode_worker.handoffs import Reservations
from kvtransfer import KVReceiver, OfferedPage, TransferError, TransferResult

logger = logging.getLogger(__name__)

# Fallback reasons (label values of pdserve_kv_prefix_fetch_fallbacks_total).
NO_ROOM = "no_room"  # no free pages to receive them in
UNSUPPORTED = "unsupported"  # this receiver cannot fetch from that source (backend, TP group)
REFUSED = "refused"  # the prefill worker holds none of them any more, or refused
TIMEOUT = "timeout"
ERROR = "error"  # the handshake or the transport failed
CHECK_FAILED = "check_failed"  # a page came that is not the prompt's: it and the rest computed


@dataclass(slots=True, eq=False)
class PrefixFetch:
    seq: Sequence
    transfer_id: str
    dst_page_ids: list[int]
    parent: int | None  # the hash of the page before the first asked for
    hashes: list[int]  # of the pages asked for
    first_page: int  # the prompt's page the first asked for is
    held_page_ids: list[int]  # the pages before it, this pool's, referenced meanwhile
    aborted: bool = False


class PrefixFetches:
    """The prefix fetches of prompts waiting to be admitted here.

    ``admit(seq)``: queue ``seq`` to be prefilled here (the worker's ``admit``);
    ``page_nbytes``: one page's bytes, scales included.
    """

    def __init__(
        self,
        receiver: KVReceiver,
        scheduler: Reservations,
        pages: PageManager,
        *,
        admit: Callable[[Sequence], bool],
        fetch_timeout: float,
        page_nbytes: int,
    ) -> None:
        self.receiver = receiver
        self.page_nbytes = page_nbytes  # one page's bytes, scales included
        self.scheduler = scheduler
        self.pages = pages
        self.fetch_timeout = fetch_timeout
        self._admit = admit
        self._by_request: dict[str, PrefixFetch] = {}
        self._by_transfer: dict[str, PrefixFetch] = {}
        self._count = 0

    def num_pending(self) -> int:
        return len(self._by_request)

    def progress(self) -> dict[str, int]:
        """Each prompt whose prefix is on its way, with the pages reserved for it."""
        return {rid: len(fetch.dst_page_ids) for rid, fetch in self._by_request.items()}

    def admit(self, seq: Sequence, source: PrefixSource | None) -> None:
        """Queue ``seq`` to be prefilled here, once the pages ``source`` holds of it are
        fetched (at once, where there is nothing to fetch or the fetch cannot start)."""
        if source is None or not self._start(seq, source):
            self._admit(seq)

    def on_result(self, result: TransferResult) -> bool:
        """Settle a fetch the receiver reports ended; whether it was one of these."""
        fetch = self._by_transfer.pop(result.transfer_id, None)
        if fetch is None:
            return False
        if fetch.aborted:
            self.scheduler.drop_reservation(fetch.dst_page_ids)
            self.pages.free(fetch.held_page_ids)
            return True
        del self._by_request[fetch.seq.request_id]
        if not result.ok:
            reason = _reason(result.error or "")
            logger.info("%s: prefix fetch failed (%s); computing it here",
                        fetch.seq.request_id, result.error)  # fmt: skip
            KV_PREFIX_FETCH_FALLBACKS.labels(reason).inc()
        else:
            self._file(fetch, result.offered)
        self.scheduler.drop_reservation(fetch.dst_page_ids)  # filed pages stay in the cache
        self.pages.free(fetch.held_page_ids)
        self._admit(fetch.seq)
        return True

    def discard(self, request_id: str) -> bool:
        """Stop fetching ``request_id``'s prefix, if it has one coming; whether it had. Its pages
        are freed once the receiver reports that nothing writes them."""
        fetch = self._by_request.pop(request_id, None)
        if fetch is None:
            return False
        fetch.aborted = True
        self.receiver.abort(fetch.transfer_id)
        return True

    # -- internals ------------------------------------------------------------------------------

    def _start(self, seq: Sequence, source: PrefixSource) -> bool:
        page_size = self.scheduler.page_size
        prompt = seq.prompt_token_ids
        # Never the last prompt token's page: it is computed to sample the first token.
        num_pages = min(source.num_pages, (len(prompt) - 1) // page_size)
        namespace = seq.cache_namespace
        held_page_ids = self.pages.match_prefix(prompt, num_pages, namespace)
        held = len(held_page_ids)
        if held >= num_pages:
            return False  # this pool holds as much already
        hashes = page_hashes(prompt[: num_pages * page_size], page_size, namespace=namespace)
        # A reference on the pages held here, so that reserving the others cannot evict them:
        # the fetched pages only chain on from them.
        self.pages.acquire(held_page_ids)
        dst = self.scheduler.reserve((num_pages - held) * page_size)
        if dst is None:
            self.pages.free(held_page_ids)
            KV_PREFIX_FETCH_FALLBACKS.labels(NO_ROOM).inc()
            return False
        self._count += 1
        transfer_id = f"{seq.request_id}/prefix{self._count}"
        parent = hashes[held - 1] if held else None
        try:
            self.receiver.start_prefix_fetch(
                transfer_id,
                source,
                parent,
                hashes[held:],
                list(prompt[held * page_size : num_pages * page_size]),
                dst,
                self.fetch_timeout,
            )
        except TransferError as exc:
            logger.info("%s: cannot fetch its prefix (%s)", seq.request_id, exc)
            KV_PREFIX_FETCH_FALLBACKS.labels(UNSUPPORTED).inc()
            self.scheduler.drop_reservation(dst)
            self.pages.free(held_page_ids)
            return False
        fetch = PrefixFetch(seq, transfer_id, dst, parent, hashes[held:], held, held_page_ids)
        self._by_request[seq.request_id] = fetch
        self._by_transfer[transfer_id] = fetch
        return True

    def _file(self, fetch: PrefixFetch, offered: tuple[OfferedPage, ...]) -> None:
        """File in the prefix cache the pages that came and are the prompt's, up to the first
        that is not."""
        page_size = self.scheduler.page_size
        prompt = fetch.seq.prompt_token_ids
        page_nbytes = self.page_nbytes
        parent = fetch.parent
        for index, (page, page_id) in enumerate(zip(offered, fetch.dst_page_ids, strict=False)):
            start = (fetch.first_page + index) * page_size
            tokens = prompt[start : start + page_size]
            expected = fetch.hashes[index]
            if (page.page_hash, page.parent, page.token_ids) != (expected, parent, tokens):
                logger.warning("%s: fetched page %d is not the prompt's; computing the rest",
                               fetch.seq.request_id, fetch.first_page + index)  # fmt: skip
                KV_PREFIX_FETCH_FALLBACKS.labels(CHECK_FAILED).inc()
                return
            self.pages.cache_page(page_id, expected, tokens, parent)
            KV_PREFIX_PAGES_FETCHED.labels(page.tier).inc()
            KV_PREFIX_BYTES_FETCHED.labels(page.tier).inc(page_nbytes)
            parent = expected


def _reason(error: str) -> str:
    if "refused" in error:
        return REFUSED
    if "timed out" in error or "lease" in error:
        return TIMEOUT
    return ERROR
