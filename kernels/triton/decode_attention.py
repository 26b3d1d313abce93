"""Paged decode attention: one query token per sequence, split-K over long contexts.

One program handles one sequence, one KV head (with all ``GROUP`` query heads that share it, so
each page is read once) and one split of the context. With few sequences a GPU would sit mostly
idle, so the context is cut into ``num_splits`` slices whose partial results, each normalised
and tagged with its log-sum-exp, a second kernel combines (flash-decoding).

Twin: the torch backend's ``paged_attention`` with every query length 1; tested against
``tests/kernel_twins.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.interface import AttentionMetadata, KVCacheView
from kernels.sizes import ceil_div, next_power_of_2
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
from kernels.triton.tiles import DecodeTiles, decode_tiles

# A split shorter than this spends more on its launch share and combine than it saves.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 128
# Decode is bound by memory: the bytes in flight per multiprocessor set its pace, and a program
# (4 warps, about 100 registers a thread, 38 KiB of shared memory on sm_90) keeps one K/V tile in
# flight, so several programs share a multiprocessor. Two each left batch 1 x 32k on an H200 at
# 36% of the memory's rate; four each is what the occupancy allows with room to spare.
_PROGRAMS_PER_MULTIPROCESSOR = 4


# The split count follows the batch and its context, the page tables' width its longest
# sequence, the window its layer; left unspecialised, so that a new count compiles nothing (see
# the prefill kernel).
@triton.jit(do_not_specialize=["num_splits", "stride_table_seq", "window"])
def _decode_kernel(
    q_ptr,  # [S, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided
    k_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    v_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    page_tables_ptr,  # [S, max_pages_per_seq] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [S, num_heads, num_splits, head_dim], or the output itself when num_splits == 1
    lse_ptr,  # [S, num_heads, num_splits] float32, log2-domain log-sum-exp of each split
    num_splits,
    page_size,
    window,  # a sliding window: keys from seq_len - window on (NO_WINDOW: all of them)
    qk_scale,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    stride_scale_page,
    stride_scale_slot,
    stride_scale_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # The keys the query sees: the whole context, or its sliding window's (the pages before it
    # are not read). Splits start a whole number of tiles after the first; the last ones may
    # be empty for a short sequence.
    first_key = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    start = first_key + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # Padding rows (BLOCK_G > GROUP, since tl.dot needs 16 rows) are zero queries, never stored.
    q = tl.load(
        q_ptr + seq * stride_q_seq + head[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    k_cache_ptr += kv_head * stride_kv_head
    v_cache_ptr += kv_head * stride_kv_head
    k_scale_ptr += kv_head * stride_scale_head
    v_scale_ptr += kv_head * stride_scale_head
    page_table_ptr = page_tables_ptr + seq.to(tl.int64) * stride_table_seq

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Whole tiles skip the masks; a split's last, partial tile (if any) is masked.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
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
        start,
        full_end,
        end,
        start,
        offs_g,  # not read: no causal mask
        window,  # not read: no causal mask
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
        CAUSAL=False,
    )

    # An empty split leaves l_i == 0: it stores zeros with a log-sum-exp of -inf (weight 0).
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = seq.to(tl.int64) * stride_out_seq + head * stride_out_head + split * stride_out_split
    tl.store(
        out_ptr + row[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )
    lse_row = (seq * tl.num_programs(1) * GROUP + head) * num_splits + split
    tl.store(lse_ptr + lse_row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    partial_ptr,  # [S, num_heads, num_splits, head_dim] float32, contiguous
    lse_ptr,  # [S, num_heads, num_splits] float32, contiguous
    out_ptr,  # [S, num_heads, head_dim]
    num_splits,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_SPLITS)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # Split 0 always holds the first key, so the max is finite.
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(
        partial_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * partial, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: keep the grid small
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    return splits_to_fill(num_seqs, num_kv_heads, max_seq_len, _multiprocessor_count(device))


def splits_to_fill(num_seqs: int, num_kv_heads: int, max_seq_len: int, multiprocessors: int) -> int:
    """Enough splits for ``_PROGRAMS_PER_MULTIPROCESSOR`` programs per multiprocessor, none
    shorter than ``_MIN_TOKENS_PER_SPLIT`` tokens."""
    programs = num_seqs * num_kv_heads
    target = _PROGRAMS_PER_MULTIPROCESSOR * multiprocessors
    if programs >= target:
        return 1
    by_occupancy = ceil_div(target, programs)
    by_length = ceil_div(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def split_counts_to_compile(num_kv_heads: int, device: torch.device) -> list[int]:
    """One split count for each compiled variant that ``default_num_splits`` can lead to on
    ``device``: 1 (the decode kernel writes the output itself, nothing to combine), then one for
    each width of the combine kernel's block of splits (the next power of two), up to the most
    splits a lone sequence of any length is given."""
    most = default_num_splits(1, num_kv_heads, _MAX_SPLITS * _MIN_TOKENS_PER_SPLIT, device)
    counts = [1]
    while counts[-1] < most:
        counts.append(min(2 * counts[-1], most))
    return counts


def decode_attention(
    query: torch.Tensor,  # [S, num_heads, head_dim]
    cache: KVCacheView,
    meta: AttentionMetadata,
    softmax_scale: float,
    window: int | None = None,
    *,
    num_splits: int | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:  # [S, num_heads, head_dim], query's dtype
    """Attention of each sequence's single new token over its whole context in ``cache``, or
    over its last ``window`` positions (a sliding-window layer: earlier pages are not read).

    ``meta`` must describe one query token per sequence. ``num_splits`` overrides the split-K
    heuristic and ``tiles`` the device's tile sizes (``kernels.triton.tiles``) for tests, the
    tuner and benchmarks; neither changes the result beyond rounding.
    """
    args = check_cache(cache, query.device)
    group = check_query(query, args)
    check_metadata(meta, query.device)
    check_softmax_scale(softmax_scale)
    kernel_window_arg = kernel_window(window)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs != meta.num_seqs or meta.max_query_len != 1:
        raise ValueError(
            f"decode attention takes one query per sequence: {num_seqs} queries for "
            f"{meta.num_seqs} sequences, max_query_len {meta.max_query_len}"
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        longest = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
        num_splits = default_num_splits(num_seqs, args.num_kv_heads, longest, query.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")

    # One split needs no combine: its normalised partial result is the output.
    if num_splits == 1:
        partial = out.unsqueeze(2)
    else:
        partial = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    block_d = head_block(head_dim)
    if tiles is None:
        tiles = decode_tiles(query.device, block_d, args.kv_quant, args.key.element_size())
    _decode_kernel[(num_seqs, args.num_kv_heads, num_splits)](
        query,
        args.key,
        args.value,
        *args.scale_pointers(),
        meta.page_tables,
        meta.seq_lens,
        partial,
        lse,
        num_splits,
        args.page_size,
        kernel_window_arg,
        softmax_scale * LOG2E,
        query.stride(0),
        query.stride(1),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        *args.kv_strides,
        *args.scale_strides,
        meta.page_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=tiles.block_n,
        KV_QUANT=args.kv_quant,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SPLITS=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
