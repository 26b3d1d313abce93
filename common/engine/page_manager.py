"""The page manager: keeps the books of the KV pool's pages, with a prefix cache.

Pages are reference-counted. A full page whose tokens are known can be *cached*: it is filed
under its chained page hash (``common/hashing.py``) together with its token ids, so a later
request with the same prefix can share it. A cached page whose count drops to zero stays
findable until the pool needs the memory; such pages are evicted least-recently-freed first,
after every page that was never cached. Every page filed or evicted is reported as an event, so a
router can keep an exact index of what each worker holds.

With KV tiers below the pool (``tiers``, ``common/engine/kv_tiers/``), a cached page the pool
reuses is handed to them first, with its hash, parent and token ids, instead of being lost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common import hashing
from common.engine.kv_tiers.block import PageKey

if TYPE_CHECKING:
    from common.engine.kv_tiers.tiers import KVTiers


@dataclass(slots=True)
class _Page:
    ref_count: int = 0
    page_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: int | None = None  # the hash of the page before it in its chain


@dataclass(slots=True)
class CacheEvents:
    """Page hashes filed in and evicted from the prefix cache since the last drain, in order."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pages = [_Page() for _ in range(num_pages)]
        # Free pages in reuse order: never-cached pages first, then cached ones oldest-freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._by_hash: dict[int, int] = {}
        self._events = CacheEvents()
        self.tiers: KVTiers | None = None  # set by the engine where tiers are configured

    # -- queries (never modify state) ----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now, cached-but-unused ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_pages

    def ref_count(self, page_id: int) -> int:
        return self._pages[page_id].ref_count

    def page_hash(self, page_id: int) -> int:
        """The hash a filed page (one ``match_prefix`` found) is filed under in the prefix cache."""
        page_hash = self._pages[page_id].page_hash
        assert page_hash is not None, f"page {page_id} is not filed in the prefix cache"
        return page_hash

    def num_cached_pages(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> list[int]:
        """Every page hash filed now: a full report for a router that lost track."""
        return list(self._by_hash)

    def cached_page(self, key: PageKey) -> int | None:
        """The page filed under ``key``'s hash, if its token ids and parent are ``key``'s (a hit
        confirmed as ``match_prefix`` confirms one), or None. Takes no reference."""
        page_id = self._by_hash.get(key.page_hash)
        if page_id is None:
            return None
        page = self._pages[page_id]
        if page.token_ids != key.token_ids or page.parent != key.parent:
            return None
        return page_id

    def match_prefix(
        self, token_ids: Sequence[int], max_pages: int | None = None, namespace: str = ""
    ) -> list[int]:
        """Pages holding the longest cached prefix of ``token_ids`` hashed in ``namespace``, in
        order (full pages only).

        A hash hit counts only if the page's token ids equal the request's, so a hash collision
        can never serve another prompt's KV. Does not take references: call ``acquire``.
        """
        if not self.enable_prefix_caching:
            return []
        limit = len(token_ids) // self.page_size
        if max_pages is not None:
            limit = min(limit, max_pages)
        hits: list[int] = []
        parent: int | None = None
        for index in range(limit):
            chunk = tuple(token_ids[index * self.page_size : (index + 1) * self.page_size])
            parent = hashing.hash_page(parent, chunk, namespace)
            page_id = self._by_hash.get(parent)
            if page_id is None or self._pages[page_id].token_ids != chunk:
                break
            hits.append(page_id)
        return hits

    # -- changes --------------------------------------------------------------------------------

    def acquire(self, page_ids: Sequence[int]) -> None:
        """Take one more reference on each page (pages found by ``match_prefix``)."""
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.ref_count == 0:
                del self._free[page_id]
            page.ref_count += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` fresh pages, evicting cached free pages if needed."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV pages, {len(self._free)} free")
        page_ids = []
        evicted: list[tuple[int, PageKey]] = []
        for _ in range(count):
            page_id, _ = self._free.popitem(last=False)
            page = self._pages[page_id]
            if page.page_hash is not None:
                if self.tiers is not None:
                    assert page.token_ids is not None
                    evicted.append((page_id, PageKey(page.page_hash, page.parent, page.token_ids)))
                self._uncache(page_id)
            page.ref_count = 1
            page_ids.append(page_id)
        if evicted:
            assert self.tiers is not None
            self.tiers.offload(evicted)  # returns once the bytes are out: the pages are free
        return page_ids

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference on each page; a page with none left becomes reusable."""
        # Freed in reverse so that a sequence's tail pages, the least likely to be shared by a
        # later prompt, are evicted before its head.
        for page_id in reversed(page_ids):
            page = self._pages[page_id]
            assert page.ref_count > 0, f"double free of KV page {page_id}"
            page.ref_count -= 1
            if page.ref_count == 0:
                self._free[page_id] = None
                if page.page_hash is None:
                    self._free.move_to_end(page_id, last=False)

    def cache_page(
        self,
        page_id: int,
        page_hash: int,
        token_ids: Sequence[int],
        parent: int | None = None,
    ) -> int:
        """File a full, computed page under its hash (``parent``: the hash of the page before
        it, kept for the tiers below); returns the page now filed there.

        If an identical page is already filed (two requests computed the same prefix at once),
        the existing one stays the cached copy and this one is left uncached.
        """
        if not self.enable_prefix_caching:
            return page_id
        page = self._pages[page_id]
        assert page.ref_count > 0, f"caching KV page {page_id} that nobody holds"
        existing = self._by_hash.get(page_hash)
        if existing is not None:
            return existing
        if page.page_hash is not None:
            return page_id
        page.page_hash = page_hash
        page.token_ids = tuple(token_ids)
        page.parent = parent
        self._by_hash[page_hash] = page_id
        self._events.stored.append(page_hash)
        return page_id

    def drain_events(self) -> CacheEvents:
        events, self._events = self._events, CacheEvents()
        return events

    def _uncache(self, page_id: int) -> None:
        page = self._pages[page_id]
        assert page.page_hash is not None
        del self._by_hash[page.page_hash]
        self._events.removed.append(page.page_hash)
        page.page_hash = None
        page.token_ids = None
        page.parent = None
