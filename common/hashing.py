"""Prefix-cache page hashes: the one place the router and every worker compute them.

A full page's hash chains its parent's hash and its own token ids, so equal hashes mean equal
prefixes (up to a 64-bit collision, which the page manager rules out by comparing token ids).
The digest is keyed by nothing process-local, so every process computes the same values.

A chain starts from its namespace: KV computed under different weights for the same tokens (a
LoRA adapter, a quantized variant of the model) must never be served from one another's pages,
so their requests hash under different namespaces. The default namespace, ``""``, is the base
model's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_BASE_ROOT = b"\x00" * 8


def hash_page(parent: int | None, token_ids: Sequence[int], namespace: str = "") -> int:
    """The hash of one full page that follows the page hashed ``parent`` (None: the first
    page of a chain in ``namespace``; a later page inherits its namespace through ``parent``)."""
    digest = hashlib.blake2b(digest_size=8, person=b"pdserve-kv")
    digest.update(_chain_root(namespace) if parent is None else parent.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def page_hashes(
    token_ids: Sequence[int], page_size: int, parent: int | None = None, namespace: str = ""
) -> list[int]:
    """Chained hashes of every full page of ``token_ids``, continuing the chain at ``parent``
    (None: from the start of ``namespace``); a trailing partial page has none."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start : start + page_size], namespace)
        hashes.append(parent)
    return hashes


def _chain_root(namespace: str) -> bytes:
    if not namespace:
        return _BASE_ROOT
    digest = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"pdserve-ns")
    return digest.digest()
