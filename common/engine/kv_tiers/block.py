"""What every tier keeps of one page besides its bytes, and the fingerprint that says whose
KV a stored page is.

A page is filed under its chained hash (``common/hashing.py``, namespace included), like the
pool's prefix cache. Its parent's hash and its token ids are kept beside it, so a hit is
confirmed as the pool confirms one: by comparing token ids (and the chain's link), never by
the hash alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from common.kv_layout import KVLayout

HOST = "host"
DISK = "disk"
TIERS = (HOST, DISK)


@dataclass(frozen=True, slots=True)
class PageKey:
    """One filed page: its chained hash, its parent's (None for a chain's first page), its
    token ids."""

    page_hash: int
    parent: int | None
    token_ids: tuple[int, ...]


def kv_fingerprint(weights: str, layout: KVLayout) -> int:
    """A 64-bit fingerprint of whose KV a page is: the weights (``weights``: the model's path,
    dtype and quantization, as the engine names them) and the page format and shape. A block
    on disk under another fingerprint is a miss: the same tokens under other weights or in
    another format are other bytes."""
    text = "|".join(
        (
            weights,
            layout.dtype,
            str(layout.page_size),
            str(layout.num_layers),
            str(layout.num_kv_heads),
            str(layout.head_dim),
            str(layout.first_kv_head),
            str(layout.model_kv_heads),
        )
    )
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"pdserve-kvfp")
    return int.from_bytes(digest.digest(), "little")
