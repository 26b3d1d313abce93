"""The block manager: keeps the books of the KV pool's pages, with a prefix cache.

Pages are reference-counted. A full page whose tokens are known can be *cached*: it is filed
under its chained block hash (``common/hashing.py``) together with its token ids, so a later
request with the same prefix can share it. A cached page whose count drops to zero stays
findable until the pool needs the memory; such pages are evicted least-recently-freed first,
after every page that was never cached. Every page filed or evicted is reported as an event, so a
router can keep an exact index of what each worker holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from common import hashing


@dataclass(slots=True)
class _Page:
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class CacheEvents:
    """Block hashes filed in and evicted from the prefix cache since the last drain, in order."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pages = [_Page() for _ in range(num_blocks)]
        # Free pages in reuse order: never-cached pages first, then cached ones oldest-freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._events = CacheEvents()

    # -- queries (never modify state) ----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now, cached-but-unused ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._pages[block_id].ref_count

    def block_hash(self, block_id: int) -> int:
        """The hash a filed page (one ``match_prefix`` found) is filed under in the prefix cache."""
        block_hash = self._pages[block_id].block_hash
        assert block_hash is not None, f"page {block_id} is not filed in the prefix cache"
        return block_hash

    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> list[int]:
        """Every block hash filed now: a full report for a router that lost track."""
        return list(self._by_hash)

    def match_prefix(
        self, token_ids: Sequence[int], max_blocks: int | None = None, namespace: str = ""
    ) -> list[int]:
        """Pages holding the longest cached prefix of ``token_ids`` hashed in ``namespace``, in
        order (full pages only).

        A hash hit counts only if the page's token ids equal the request's, so a hash collision
        can never serve another prompt's KV. Does not take references: call ``acquire``.
        """
        if not self.enable_prefix_caching:
            return []
        limit = len(token_ids) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hits: list[int] = []
        parent: int | None = None
        for index in range(limit):
            chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = hashing.hash_block(parent, chunk, namespace)
            block_id = self._by_hash.get(parent)
            if block_id is None or self._pages[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    # -- changes --------------------------------------------------------------------------------

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each page (pages found by ``match_prefix``)."""
        for block_id in block_ids:
            page = self._pages[block_id]
            if page.ref_count == 0:
                del self._free[block_id]
            page.ref_count += 1

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` fresh pages, evicting cached free pages if needed."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV pages, {len(self._free)} free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            page = self._pages[block_id]
            if page.block_hash is not None:
                self._uncache(block_id)
            page.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each page; a page with none left becomes reusable."""
        # Freed in reverse so that a sequence's tail pages, the least likely to be shared by a
        # later prompt, are evicted before its head.
        for block_id in reversed(block_ids):
            page = self._pages[block_id]
            assert page.ref_count > 0, f"double free of KV page {block_id}"
            page.ref_count -= 1
            if page.ref_count == 0:
                self._free[block_id] = None
                if page.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> int:
        """File a full, computed page under its hash; returns the page now filed there.

        If an identical page is already filed (two requests computed the same prefix at once),
        the existing one stays the cached copy and this one is left uncached.
        """
        if not self.enable_prefix_caching:
            return block_id
        page = self._pages[block_id]
        assert page.ref_count > 0, f"caching KV page {block_id} that nobody holds"
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing
        if page.block_hash is not None:
            return block_id
        page.block_hash = block_hash
        page.token_ids = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        self._events.stored.append(block_hash)
        return block_id

    def drain_events(self) -> CacheEvents:
        events, self._events = self._events, CacheEvents()
        return events

    def _uncache(self, block_id: int) -> None:
        page = self._pages[block_id]
        assert page.block_hash is not None
        del self._by_hash[page.block_hash]
        self._events.removed.append(page.block_hash)
        page.block_hash = None
        page.token_ids = None
