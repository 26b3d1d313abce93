"""The host-memory tier: a slab of page slots in the pool's own format, filed by page hash.

The slab is ``(num_slots, *page_shape)`` like the pool (one slot is one contiguous span), plus
a slab of scales for quantised pools. Pages stay in the pool's format: turning bf16 pages into
int8 here would make a restored page other bytes than the computed one, and a restored prefix
would no longer give the tokens its computation gives (a pool already in int8 gives int8 slots).

Only the step thread calls this class; the mover reads and writes slots that the step thread
pinned for it (``pin``), which eviction never reuses until they are unpinned.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from common.engine.kv_tiers.block import PageKey


@dataclass(slots=True)
class _Entry:
    slot: int
    key: PageKey
    pins: int = 0


class HostTier:
    def __init__(
        self,
        num_slots: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        scale_shape: tuple[int, ...] | None,
        scale_dtype: torch.dtype | None,
        pin_memory: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one page slot, got {num_slots}")
        self.num_slots = num_slots
        # empty, not zeros: the kernel backs a slot with memory when it is first written.
        self.data = torch.empty((num_slots, *page_shape), dtype=dtype, pin_memory=pin_memory)
        self.scales = (
            torch.empty((num_slots, *scale_shape), dtype=scale_dtype, pin_memory=pin_memory)
            if scale_shape is not None and scale_dtype is not None
            else None
        )
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.stored: list[int] = []  # page hashes filed since the last drain (router events)
        self.removed: list[int] = []
        self.num_evicted = 0

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def find(self, key: PageKey) -> int | None:
        """The slot holding ``key``'s page (its token ids and parent confirmed), or None. A hit
        counts as a use for LRU."""
        entry = self._entries.get(key.page_hash)
        if entry is None or entry.key != key:
            return None
        self._entries.move_to_end(key.page_hash)
        return entry.slot

    def touch(self, page_hash: int) -> bool:
        """Mark a page used again (the pool evicted a page this tier already holds)."""
        if page_hash not in self._entries:
            return False
        self._entries.move_to_end(page_hash)
        return True

    def take_slot(self, key: PageKey) -> int | None:
        """A slot to file ``key``'s page in, evicting the least recently used unpinned page if
        none is free; None when every slot is pinned. The caller writes the slot at once."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            self.removed.append(victim)
            self.num_evicted += 1
        self._entries[key.page_hash] = _Entry(slot, key)
        self.stored.append(key.page_hash)
        return slot

    def pin(self, page_hash: int) -> None:
        self._entries[page_hash].pins += 1

    def unpin(self, page_hash: int) -> None:
        entry = self._entries[page_hash]
        assert entry.pins > 0, f"unpinning host page {page_hash:x} that nobody pinned"
        entry.pins -= 1

    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)
