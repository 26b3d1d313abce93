"""``KVTiers``: the tiers below one worker's pool, as the page manager and the scheduler see them.

Down: when the page manager hands out a free page that the prefix cache held, it calls
``offload`` first, on the step thread, before anyone can write the page. The page is copied at
once into a host slot (a memcpy of one contiguous span per page) and, with a disk tier, its
bytes are gathered into one buffer that the mover writes out. Copying at eviction, rather than
deferring the page's reuse until a background copy lands, keeps the pool's books as they are:
a page handed out is the caller's at once, and no forward ever waits on a copy. The slow part,
the disk, is off the step thread.

Up: at admission, after the pool's own prefix match, ``lookup`` walks the chain on through the
tiers (host first, then disk) and the scheduler restores what it finds into fresh pool pages
through ``start_restore``; the mover copies them while the sequence waits aside, and ``settle``
says how many of its pages landed whole (a damaged disk block ends the run there: the rest is
computed).

Only the step thread calls this class.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common import hashing
from common.engine.kv_pool import KVPool, scale_dtype
from common.engine.kv_tiers.block import DISK, HOST, PageKey
from common.engine.kv_tiers.disk import DiskTier
from common.engine.kv_tiers.host import HostTier
from common.engine.kv_tiers.mover import Job, Mover
from common.metrics import (
    KV_TIER_BYTES,
    KV_TIER_DROPPED_WRITES,
    KV_TIER_EVICTIONS,
    KV_TIER_HITS,
    KV_TIER_MISSES,
    KV_TIER_REJECTED,
    KV_TIER_RESTORE_SECONDS,
)

# Disk writes waiting for the mover, at most: past it a page goes down to host only (or is
# lost), so a disk slower than the evictions cannot grow the worker's memory without bound.
MAX_PENDING_WRITE_BYTES = 256 << 20


@dataclass(slots=True)
class FoundPage:
    """A page ``lookup`` found below the pool: its key and its host slot (None: on disk)."""

    key: PageKey
    host_slot: int | None


@dataclass(slots=True, eq=False)
class Restore:
    """Pages on their way up into a sequence's pool pages. ``num_landed`` (set by the mover):
    how many of them, from the first, are whole in the pool."""

    pages: list[FoundPage]
    pool_pages: list[int] = field(default_factory=list)
    job: Job | None = None
    num_landed: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    follows: bool = False  # only waits for another sequence's restore (``follow``)

    @property
    def done(self) -> bool:
        return self.job is not None and self.job.done.is_set()


@dataclass(slots=True)
class TierEvents:
    tier: str
    stored: list[int]
    removed: list[int]


class KVTiers:
    def __init__(
        self,
        pool: KVPool,
        host_bytes: int = 0,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        fingerprint: int = 0,
    ) -> None:
        """``host_bytes``: the host tier's size (0: none); ``disk_dir`` and ``disk_bytes``: the
        disk tier's directory and size (None: none); ``fingerprint``: whose KV the pages are
        (``block.kv_fingerprint``)."""
        self.pool = pool
        layout = pool.layout
        self.page_size = layout.page_size
        self.host: HostTier | None = None
        if host_bytes:
            num_slots = host_bytes // layout.bytes_per_page
            if num_slots < 1:
                raise ValueError(
                    f"--kv-offloading-size {host_bytes} bytes holds no KV page "
                    f"({layout.bytes_per_page} bytes each)"
                )
            scales = pool.scales
            self.host = HostTier(
                num_slots,
                tuple(pool.data.shape[1:]),
                pool.data.dtype,
                tuple(scales.shape[1:]) if scales is not None else None,
                scale_dtype(layout),
                pin_memory=pool.device.type == "cuda",
            )
        self.disk = DiskTier(disk_dir, disk_bytes, fingerprint) if disk_dir else None
        if self.host is None and self.disk is None:
            raise ValueError("KV tiers need a host size or a disk directory")
        self.mover = Mover()
        self._pending_write_bytes = 0
        self._pending_lock = threading.Lock()
        self._evicted_seen = {HOST: 0, DISK: 0}
        self._rejected_seen: dict[str, int] = {}

    # -- down -----------------------------------------------------------------------------------

    def offload(self, pages: Sequence[tuple[int, PageKey]]) -> None:
        """Keep the pool pages ``pages`` (page id, key), which the pool is about to reuse.
        Returns once their bytes are copied out: the caller may overwrite them then."""
        data, scales = self.pool.data, self.pool.scales
        host, disk = self.host, self.disk
        to_disk: list[tuple[int, PageKey]] = []
        moved = 0
        for page_id, key in pages:
            if host is not None and not host.touch(key.page_hash):
                slot = host.take_slot(key)
                if slot is not None:
                    host.data[slot].copy_(data[page_id])
                    if scales is not None and host.scales is not None:
                        host.scales[slot].copy_(scales[page_id])
                    moved += 1
            if disk is not None and not disk.contains(key.page_hash):
                to_disk.append((page_id, key))
        if moved:
            KV_TIER_BYTES.labels(HOST, "offload").inc(moved * self.pool.layout.bytes_per_page)
        if to_disk:
            self._write_down(to_disk)

    def _write_down(self, pages: list[tuple[int, PageKey]]) -> None:
        """Gather the pages' bytes into one buffer (one copy, on this thread) and queue their
        write; dropped if the mover is that far behind already."""
        size = len(pages) * self.pool.layout.bytes_per_page
        with self._pending_lock:
            if self._pending_write_bytes + size > MAX_PENDING_WRITE_BYTES:
                KV_TIER_DROPPED_WRITES.inc(len(pages))
                return
            self._pending_write_bytes += size
        ids = torch.tensor([page_id for page_id, _ in pages], device=self.pool.device)
        data = self.pool.data.index_select(0, ids).cpu()
        pool_scales = self.pool.scales
        scales = pool_scales.index_select(0, ids).cpu() if pool_scales is not None else None
        keys = [key for _, key in pages]
        disk = self.disk
        assert disk is not None

        def write(job: Job) -> None:
            try:
                written = 0
                for index, key in enumerate(keys):
                    page = data[index].view(-1).view(torch.uint8).numpy().data
                    scale = (
                        scales[index].view(-1).view(torch.uint8).numpy().data
                        if scales is not None
                        else memoryview(b"")
                    )
                    written += disk.put(key, page, scale)
                KV_TIER_BYTES.labels(DISK, "offload").inc(written)
            finally:
                with self._pending_lock:
                    self._pending_write_bytes -= size

        self.mover.submit(Job(write))

    # -- up -------------------------------------------------------------------------------------

    def lookup(
        self,
        token_ids: Sequence[int],
        start_page: int,
        parent: int | None,
        namespace: str,
        max_pages: int,
        count_misses: bool = True,
    ) -> list[FoundPage]:
        """The pages of ``token_ids`` from page ``start_page`` on (the first one the pool
        lacks; ``parent``: the hash of the page before it) that the tiers hold, in order, up to
        ``max_pages`` in all; the run stops at the first page none holds, a miss of each tier
        where ``count_misses`` (false for a prompt looked up before)."""
        found: list[FoundPage] = []
        page_size, host, disk = self.page_size, self.host, self.disk
        for index in range(start_page, max_pages):
            chunk = tuple(token_ids[index * page_size : (index + 1) * page_size])
            page_hash = hashing.hash_page(parent, chunk, namespace)
            key = PageKey(page_hash, parent, chunk)
            slot = host.find(key) if host is not None else None
            if slot is not None:
                found.append(FoundPage(key, slot))
            elif disk is not None and disk.contains(page_hash):
                found.append(FoundPage(key, None))
            else:
                for tier, present in ((HOST, host), (DISK, disk)):
                    if present is not None and count_misses:
                        KV_TIER_MISSES.labels(tier).inc()
                break
            parent = page_hash
        return found

    def start_restore(self, pages: list[FoundPage]) -> Restore:
        """Reserve ``pages`` for a restore (their host slots stay put until ``settle``); call
        before allocating the pool pages they go to (an allocation may offload, and so evict
        from the host tier), then ``submit``."""
        if self.host is not None:
            for page in pages:
                if page.host_slot is not None:
                    self.host.pin(page.key.page_hash)
        return Restore(pages)

    def submit(self, restore: Restore, pool_pages: list[int]) -> None:
        """Copy ``restore``'s pages into ``pool_pages`` (one each, in order) on the mover."""
        assert len(pool_pages) == len(restore.pages)
        restore.pool_pages = pool_pages
        restore.job = self.mover.submit(Job(lambda job: self._restore(restore, job)))

    def follow(self, restore: Restore) -> Restore:
        """A restore of nothing that is done when ``restore`` is: for a sequence whose next
        pages ``restore`` is bringing up for another."""
        assert restore.job is not None
        return Restore([], job=restore.job, follows=True)

    def _restore(self, restore: Restore, job: Job) -> None:
        """The mover's half of a restore: each page in order, stopping at the first that does
        not land whole (a disk block that fails its checks)."""
        pool, host, disk = self.pool, self.host, self.disk
        bytes_per_page = pool.layout.bytes_per_page
        for page, page_id in zip(restore.pages, restore.pool_pages, strict=True):
            if job.cancelled:
                return
            if page.host_slot is not None:
                assert host is not None
                pool.data[page_id].copy_(host.data[page.host_slot])
                if pool.scales is not None and host.scales is not None:
                    pool.scales[page_id].copy_(host.scales[page.host_slot])
                tier = HOST
            else:
                assert disk is not None
                if not read_disk_page(
                    disk, page.key, pool.page_bytes(page_id), pool.scale_bytes(page_id)
                ):
                    KV_TIER_MISSES.labels(DISK).inc()
                    return
                tier = DISK
            restore.num_landed += 1
            restore.bytes_by_tier[tier] = restore.bytes_by_tier.get(tier, 0) + bytes_per_page

    def settle(self, restore: Restore) -> int:
        """A done restore's pages landed whole, from the first; unpins its host slots."""
        assert restore.done
        if restore.follows:
            return 0
        if self.host is not None:
            for page in restore.pages:
                if page.host_slot is not None:
                    self.host.unpin(page.key.page_hash)
        job = restore.job
        assert job is not None
        if not job.cancelled:
            for tier, count in restore.bytes_by_tier.items():
                KV_TIER_BYTES.labels(tier, "restore").inc(count)
            for page in restore.pages[: restore.num_landed]:
                KV_TIER_HITS.labels(HOST if page.host_slot is not None else DISK).inc()
            KV_TIER_RESTORE_SECONDS.observe(job.seconds)
        return restore.num_landed if not job.cancelled else 0

    def wait(self, restores: list[Restore], timeout: float) -> bool:
        """Block until one of ``restores`` is done or ``timeout`` passes."""
        jobs = [r.job for r in restores if r.job is not None]
        return self.mover.wait_any(jobs, timeout)

    # -- books for the router -------------------------------------------------------------------

    def drain_events(self) -> list[TierEvents]:
        """Pages filed in and dropped from each tier since the last call, for the router; also
        brings the eviction and rejection counters up to date."""
        events = []
        if self.host is not None:
            host = self.host
            if host.stored or host.removed:
                events.append(TierEvents(HOST, host.stored, host.removed))
                host.stored, host.removed = [], []
            self._count_evictions(HOST, host.num_evicted)
        if self.disk is not None:
            stored, removed = self.disk.drain_events()
            if stored or removed:
                events.append(TierEvents(DISK, stored, removed))
            self._count_evictions(DISK, self.disk.num_evicted)
            for reason, count in list(self.disk.rejected.items()):
                seen = self._rejected_seen.get(reason, 0)
                if count > seen:
                    KV_TIER_REJECTED.labels(reason).inc(count - seen)
                    self._rejected_seen[reason] = count
        return events

    def held_hashes(self) -> list[TierEvents]:
        """Every page each tier holds now, as events (a full report)."""
        self.drain_events()
        held = []
        if self.host is not None:
            held.append(TierEvents(HOST, self.host.hashes(), []))
        if self.disk is not None:
            held.append(TierEvents(DISK, self.disk.hashes(), []))
        return held

    def _count_evictions(self, tier: str, total: int) -> None:
        if total > self._evicted_seen[tier]:
            KV_TIER_EVICTIONS.labels(tier).inc(total - self._evicted_seen[tier])
            self._evicted_seen[tier] = total

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every copy and write queued so far is done (tests, shutdown)."""
        return self.mover.flush(timeout)

    def close(self) -> None:
        """Finish the writes queued, then stop the mover."""
        self.mover.flush(timeout=30)
        self.mover.close()


def read_disk_page(
    disk: DiskTier, key: PageKey, data: torch.Tensor, scales: torch.Tensor | None
) -> bool:
    """Copy page ``key``'s block into ``data`` and, for an 8-bit pool, its scales into
    ``scales`` (a page's byte views: a pool page or a staging row); False, nothing copied,
    where the block is a miss (``DiskTier.get``) or not a page of this shape. Mover thread."""
    block = disk.get(key)
    if block is None or len(block[0]) != data.numel():
        return False
    data.copy_(torch.frombuffer(block[0], dtype=torch.uint8))
    if scales is not None:
        scales.copy_(torch.frombuffer(block[1], dtype=torch.uint8))
    return True
