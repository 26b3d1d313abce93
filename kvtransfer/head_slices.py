"""Copies of a run of KV heads out of pages and into them, for fetches between tensor-parallel
ranks that hold different heads.

A page is ``[layers, 2, page_size, kv_heads, head_dim]`` (its scales ``[layers, 2, page_size,
kv_heads]``), so a run of heads is strided in it: ``layers * 2 * page_size`` pieces of
``heads * head_dim`` elements. Both backends move such a run as a contiguous block per page (the
ZMQ sender gathers it; the NIXL receiver reads whole source pages into staging) and the receiver
writes the block into its own pages' heads with one strided copy per tensor. Heads are axis 4
of a pool's data and of its scales alike (axis 0 is the page).
"""

from __future__ import annotations

import torch

HEAD_AXIS = 4


def gather_heads(pool_tensor: torch.Tensor, page_ids: list[int], heads: range) -> torch.Tensor:
    """Pages ``page_ids`` of ``pool_tensor`` (the pool's data or scales), only local heads
    ``heads``, as contiguous host rows of bytes: ``[len(page_ids), bytes of a sliced page]``."""
    index = torch.tensor(page_ids, device=pool_tensor.device)
    pages = pool_tensor.index_select(0, index).narrow(HEAD_AXIS, heads.start, len(heads))
    return pages.contiguous().cpu().view(torch.uint8).reshape(len(page_ids), -1)


def as_pages(rows: torch.Tensor, like: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Byte rows (one page each) seen as pages of ``like``'s dtype and shape with ``num_heads``
    heads; no copy."""
    shape = list(like.shape)
    shape[0], shape[HEAD_AXIS] = rows.shape[0], num_heads
    return rows.view(like.dtype).view(shape)


def scatter_heads(
    pool_tensor: torch.Tensor, page_ids: list[int], heads: range, pages: torch.Tensor
) -> None:
    """Write ``pages`` (``[len(page_ids), ..., len(heads), ...]``, any device) into local heads
    ``heads`` of pages ``page_ids`` of ``pool_tensor``, leaving the other heads as they are."""
    index = torch.tensor(page_ids, device=pool_tensor.device)
    target = pool_tensor.narrow(HEAD_AXIS, heads.start, len(heads))
    pages = pages.to(pool_tensor.device)
    if pool_tensor.element_size() == 1:  # index_copy_ has no FP8 kernels; bytes are bytes
        target, pages = target.view(torch.uint8), pages.view(torch.uint8)
    target.index_copy_(0, index, pages)
