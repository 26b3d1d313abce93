"""Prefix-cache block hashes: the one function the router and every worker share.

A full block's hash chains its parent's hash and its own token ids, so equal hashes mean equal
prefixes (up to a 64-bit collision, which the block manager rules out by comparing token ids).
The digest is keyed by nothing process-local, so every process computes the same values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT_PARENT = b"\x00" * 8


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """The hash of one full block that follows the block hashed ``parent`` (None: the first)."""
    digest = hashlib.blake2b(digest_size=8, person=b"pdserve-kv")
    digest.update(_ROOT_PARENT if parent is None else parent.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
