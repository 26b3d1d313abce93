"""What a prefill worker lends to a decode worker's prefix fetch: pages straight from where
they are.

A decode worker prefilling a prompt itself asks for the prompt's leading pages by their hashes
(``kvtransfer/base.py``'s prefix fetch). ``PrefixLoans.lend`` walks the chain through this
worker's pool and the KV tiers below it, as admission does, and pins each page where it finds
it, without bringing anything into the pool and without a step:

- **pool**: a page filed in the prefix cache takes a reference, so the pool cannot reuse it;
- **host**: a host-tier slot is pinned, so eviction cannot reuse it;
- **disk**: the block is read on the tiers' mover thread into a staging buffer of the loan's
  own; the loan is ready once the reads are done, and a block that fails its checks ends the
  run there (the pages after it are not lent).

Each page is confirmed as the pool and the tiers confirm a hit: by its hash, its parent's and
its token ids. The loan ends (``end``) when the fetch is over; references and pins go back then.

Only the worker's main loop calls this, between steps (``KVSender.poll``); the mover touches
only the loan's staging buffer and the disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.kv_pool import KVPool
from common.engine.kv_tiers.block import DISK, HOST, PageKey
from common.engine.kv_tiers.mover import Job
from common.engine.kv_tiers.tiers import KVTiers, read_disk_page
from common.engine.page_manager import PageManager
from common.metrics import KV_PREFIX_PAGES_LENT
from kvtransfer import OfferedPage, PrefixLender, PrefixLoan

POOL = "pool"


@dataclass(slots=True)
class _Lent:
    key: PageKey
    tier: str
    where: int  # pool page, host slot, or row of the disk staging buffer


@dataclass(slots=True, eq=False)
class Loan(PrefixLoan):
    """One fetch's pages, pinned where they are (see the module docstring)."""

    lender: PrefixLoans
    lent: list[_Lent]
    staging: list[torch.Tensor] = field(default_factory=list)  # disk pages: data, then scales
    job: Job | None = None  # the disk reads; None without disk pages
    num_read: int = 0  # disk pages read whole, from the first (set by the mover)
    ended: bool = False

    @property
    def ready(self) -> bool:
        return self.job is None or self.job.done.is_set()

    @property
    def pages(self) -> list[OfferedPage]:
        assert self.ready
        return [
            OfferedPage(item.key.page_hash, item.key.parent, list(item.key.token_ids), item.tier)
            for item in self._whole()
        ]

    def rows(self) -> list[list]:
        assert self.ready
        return self.lender.rows(self._whole(), self.staging)

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.job is not None:
            self.job.cancelled = True  # the reads land in the staging buffer only: let them go
        self.lender.give_back(self.lent)

    def _whole(self) -> list[_Lent]:
        """The pages lent, up to the first disk block that could not be read."""
        if self.job is None:
            return self.lent
        for index, item in enumerate(self.lent):
            if item.tier == DISK and item.where >= self.num_read:
                return self.lent[:index]
        return self.lent


class PrefixLoans(PrefixLender):
    """Lends pages of this worker's pool (``pages``, its prefix cache) and of its KV tiers
    (``tiers``; None: none)."""

    def __init__(self, pool: KVPool, pages: PageManager, tiers: KVTiers | None) -> None:
        self.pool = pool
        self.pages = pages
        self.tiers = tiers

    def lend(self, parent: int | None, page_hashes: list[int], token_ids: list[int]) -> Loan:
        page_size = self.pages.page_size
        if not page_hashes or len(token_ids) != len(page_hashes) * page_size:
            raise ValueError(f"{len(token_ids)} tokens for {len(page_hashes)} pages")
        host = self.tiers.host if self.tiers is not None else None
        disk = self.tiers.disk if self.tiers is not None else None
        lent: list[_Lent] = []
        num_disk = 0
        for index, page_hash in enumerate(page_hashes):
            chunk = tuple(token_ids[index * page_size : (index + 1) * page_size])
            key = PageKey(page_hash, parent, chunk)
            page_id = self.pages.cached_page(key)
            slot = host.find(key) if page_id is None and host is not None else None
            if page_id is not None:
                self.pages.acquire([page_id])
                lent.append(_Lent(key, POOL, page_id))
            elif slot is not None:
                assert host is not None
                host.pin(page_hash)
                lent.append(_Lent(key, HOST, slot))
            elif disk is not None and disk.contains(page_hash):
                lent.append(_Lent(key, DISK, num_disk))
                num_disk += 1
            else:
                break
            parent = page_hash
        loan = Loan(self, lent)
        if num_disk:
            self._read_from_disk(loan, num_disk)
        for item in lent:
            if item.tier != DISK:  # disk pages count once read
                KV_PREFIX_PAGES_LENT.labels(item.tier).inc()
        return loan

    def rows(self, lent: list[_Lent], staging: list[torch.Tensor]) -> list[list]:
        """Each lent page's bytes, per tensor (data, then any scales): buffers ZMQ can send."""
        host = self.tiers.host if self.tiers is not None else None
        pool_tensors = [t for t in (self.pool.data, self.pool.scales) if t is not None]
        host_tensors = [t for t in (host.data, host.scales) if t is not None] if host else []
        out: list[list] = [[] for _ in pool_tensors]
        for item in lent:
            for index, rows in enumerate(out):
                if item.tier == POOL:
                    rows.append(_page_row(pool_tensors[index], item.where))
                elif item.tier == HOST:
                    rows.append(_page_row(host_tensors[index], item.where))
                else:
                    rows.append(staging[index][item.where].numpy())
        return out

    def give_back(self, lent: list[_Lent]) -> None:
        host = self.tiers.host if self.tiers is not None else None
        pool_pages = [item.where for item in lent if item.tier == POOL]
        if pool_pages:
            self.pages.free(pool_pages)
        for item in lent:
            if item.tier == HOST:
                assert host is not None
                host.unpin(item.key.page_hash)

    def _read_from_disk(self, loan: Loan, num_disk: int) -> None:
        """Read the loan's disk pages into its staging buffer on the mover, in order, stopping
        at the first block that does not check (missing, damaged, another page's)."""
        tiers = self.tiers
        assert tiers is not None and tiers.disk is not None
        disk = tiers.disk
        data_bytes = self.pool.page_bytes(0).numel()
        scale_view = self.pool.scale_bytes(0)
        loan.staging = [torch.empty((num_disk, data_bytes), dtype=torch.uint8)]
        if scale_view is not None:
            loan.staging.append(torch.empty((num_disk, scale_view.numel()), dtype=torch.uint8))
        keys = [item.key for item in loan.lent if item.tier == DISK]
        staging = loan.staging

        def read(job: Job) -> None:
            for index, key in enumerate(keys):
                scales = staging[1][index] if len(staging) > 1 else None
                if job.cancelled or not read_disk_page(disk, key, staging[0][index], scales):
                    return
                loan.num_read = index + 1
                KV_PREFIX_PAGES_LENT.labels(DISK).inc()

        loan.job = tiers.mover.submit(Job(read))


def _page_row(tensor: torch.Tensor, index: int):
    """Page ``index`` of a page-major tensor as flat bytes ZMQ can send (a view on a CPU; a
    device page is copied to host memory)."""
    page = tensor[index]
    if page.device.type != "cpu":
        page = page.cpu()
    return page.reshape(-1).view(torch.uint8).numpy()
