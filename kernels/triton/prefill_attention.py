"""Chunked-prefill flash attention over the paged pool.

Every sequence of the batch brings a chunk of ``q`` new query tokens whose keys and values are
already stored; each attends causally over its cached prefix and the chunk itself. A chunk of one
token is an ordinary decode step, and a short chunk verifies speculative tokens, so this kernel
serves any mix.

Work is split into query tiles of ``BLOCK_Q`` tokens of one sequence for all ``GROUP`` query
heads that share a KV head: the tile's ``BLOCK_M = BLOCK_Q * GROUP`` rows are (token, head)
pairs, so each key/value tile is read once per KV head and a one-token chunk still fills
``GROUP`` rows. The grid is flat over query tiles (``N // BLOCK_Q + S`` bound, no host sync) and
each program finds its sequence by binary search over ``query_start_loc``. Programs take the
tiles in reverse, so the heaviest tiles of a causal prompt (its last) are scheduled first.

Twin: the torch backend's ``paged_attention``; tested against ``tests/kernel_twins.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interface import AttentionMetadata, KVCacheView
from kernels.sizes import next_power_of_2
from kernels.triton.paged import (
    LOG2E,
    attend_span,
    check_cache,
    check_metadata,
    check_query,
    check_softmax_scale,
    head_block,
    kernel_window,
)
from kernels.triton.tiles import PrefillTiles, prefill_tiles


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile ``tile``.

    Sequence ``i`` owns tiles ``query_start_loc[i] // BLOCK_Q + i`` onwards: a bound that rises
    with ``i`` and leaves room for each sequence's last, partial tile.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# A batch's sequence count changes from call to call, and so does its page tables' width (the
# longest sequence's pages): specialised, a count of 1 or a multiple of 16 would compile the
# kernel again (seconds, in front of a request) the first time it came.
@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq", "window"])
def _prefill_kernel(
    q_ptr,  # [N, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided
    k_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    v_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    page_tables_ptr,  # [S, max_pages_per_seq] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [N, num_heads, head_dim]
    num_seqs,
    page_size,
    window,  # a sliding window: keys past each query's position - window (NO_WINDOW: all)
    qk_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    stride_scale_page,
    stride_scale_slot,
    stride_scale_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # Backwards: a sequence's last query tiles see the most keys, so they start first and the
    # light ones fill in behind them, instead of a few heavy tiles running on alone at the end.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first chunk token of this tile
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    query_pos = prefix_len + token

    k_cache_ptr += kv_head * stride_kv_head
    v_cache_ptr += kv_head * stride_kv_head
    k_scale_ptr += kv_head * stride_scale_head
    v_scale_ptr += kv_head * stride_scale_head
    page_table_ptr = page_tables_ptr + seq.to(tl.int64) * stride_table_seq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys at or before the tile's first query are visible to every row: those tiles skip the
    # masks. Keys past the tile's last query are masked for every row: the span stops there.
    # The tiles start at key 0 in one size whatever the chunk (deterministic inference relies
    # on that order). Through a sliding window, they start at the tile holding the first key
    # the tile's first row sees (the tiles before it would add exact zeros), and those before
    # the first key that its last row sees are masked as well: the head of the span.
    kv_end = tl.minimum(prefix_len + first + BLOCK_Q, seq_len)
    seen_from = tl.maximum(prefix_len + first - window + 1, 0)
    seen_by_all_from = tl.maximum(kv_end - window, 0)
    kv_start = seen_from // BLOCK_N * BLOCK_N
    head_end = tl.minimum(tl.cdiv(seen_by_all_from, BLOCK_N) * BLOCK_N, kv_end)
    unmasked_end = tl.maximum((prefix_len + first + 1) // BLOCK_N * BLOCK_N, head_end)
    acc, m_i, l_i = attend_span(
        q,
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        page_table_ptr,
        kv_start,
        kv_start,
        head_end,
        seen_from,
        query_pos,
        window,
        offs_d,
        d_mask,
        page_size,
        stride_kv_page,
        stride_kv_slot,
        stride_scale_page,
        stride_scale_slot,
        qk_scale,
        BLOCK_N,
        KV_QUANT,
        CAUSAL=True,
    )
    acc, m_i, l_i = attend_span(
        q,
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        page_table_ptr,
        head_end,
        unmasked_end,
        kv_end,
        seen_from,
        query_pos,
        window,
        offs_d,
        d_mask,
        page_size,
        stride_kv_page,
        stride_kv_slot,
        stride_scale_page,
        stride_scale_slot,
        qk_scale,
        BLOCK_N,
        KV_QUANT,
        CAUSAL=True,
    )

    # Every real row sees its own key, so l_i > 0 there; padding rows are not stored (through
    # a window they may have seen no key at all: they divide by 1, not 0).
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + q_row[:, None] * stride_out_token
        + head[:, None] * stride_out_head
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    query: torch.Tensor,  # [N, num_heads, head_dim]
    cache: KVCacheView,
    meta: AttentionMetadata,
    softmax_scale: float,
    window: int | None = None,
    *,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim], query's dtype
    """Causal attention of every query token over its sequence's context in ``cache``, or over
    its last ``window`` positions up to its own (a sliding-window layer).

    Any mix of query lengths (including one) is allowed; the step's keys and values must
    already be stored. ``tiles`` overrides the device's tile sizes (``kernels.triton.tiles``;
    tests, the tuner).
    """
    args = check_cache(cache, query.device)
    group = check_query(query, args)
    check_metadata(meta, query.device)
    check_softmax_scale(softmax_scale)
    kernel_window_arg = kernel_window(window)
    num_tokens, _, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out

    block_d = head_block(head_dim)
    if tiles is None:
        tiles = prefill_tiles(query.device, block_d, args.kv_quant)
    # A tile holds whole GQA groups: at least one group's rows, rounded up to a power of two.
    block_m = max(tiles.block_m, next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + meta.num_seqs, args.num_kv_heads)
    _prefill_kernel[grid](
        query,
        args.key,
        args.value,
        *args.scale_pointers(),
        meta.page_tables,
        meta.query_start_loc,
        meta.seq_lens,
        out,
        meta.num_seqs,
        args.page_size,
        kernel_window_arg,
        softmax_scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *args.kv_strides,
        *args.scale_strides,
        meta.page_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        KV_QUANT=args.kv_quant,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
