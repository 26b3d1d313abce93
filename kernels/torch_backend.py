"""The portable attention backend: the paged KV store and attention in plain torch (SDPA).

It serves where the C kernels cannot be built (no compiler) and on any device torch runs on; the
CPU backend takes its store for page formats and rows the C store does not take, and its context
gather for prefill chunks that go to SDPA. Attention runs through SDPA in the query's dtype; each
sequence's context is gathered from its pages first. The Triton and C backends compute the same
attention, summed in float32 in another order (``kernels/interface.py`` has the batch layout).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.interface import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheView,
    check_window,
    window_start,
)
from kernels.kv_formats import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from kernels.sizes import ceil_div


def store_kv(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,  # [N, num_kv_heads, head_dim]
    cache: KVCacheView,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    page_size = cache.page_size
    page_ids = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - page_ids * page_size
    for new, pages, scales in (
        (key, cache.key, cache.key_scale),
        (value, cache.value, cache.value_scale),
    ):
        if cache.is_quantized:
            assert scales is not None
            quantized, scale = quantize_fp8(new) if cache.is_fp8 else quantize_int8(new)
            # index_put is not implemented for float8 on every device; bytes are bytes.
            pages.view(torch.uint8)[page_ids, offsets] = quantized.view(torch.uint8)
            scales[page_ids, offsets] = scale
        else:
            pages[page_ids, offsets] = new.to(pages.dtype)


def gather_context(
    cache: KVCacheView,
    page_tables: torch.Tensor,  # [S, num_pages_needed] int
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [S, num_pages_needed * page_size, Hkv, D]
    num_seqs, num_pages = page_tables.shape
    # index_select copies whole pages (each contiguous within the strided view); advanced
    # indexing with a 2-D index walks element by element and is several times slower.
    flat_ids = page_tables.reshape(-1)

    def gather(pages: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        gathered = torch.index_select(pages, 0, flat_ids)
        if cache.is_quantized:
            assert scales is not None
            dequantize = dequantize_fp8 if cache.is_fp8 else dequantize_int8
            gathered = dequantize(gathered, torch.index_select(scales, 0, flat_ids))
        gathered = gathered.to(dtype)
        _, page_size, heads, dim = gathered.shape
        return gathered.view(num_seqs, num_pages * page_size, heads, dim)

    return gather(cache.key, cache.key_scale), gather(cache.value, cache.value_scale)


def paged_attention(
    query: torch.Tensor,  # [N, num_heads, head_dim]
    cache: KVCacheView,
    meta: AttentionMetadata,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim]
    check_window(window)
    page_size = cache.page_size
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]

    # Decode rows (one query each) attend in one padded batch; a loop over them would cost a
    # dozen small ops per sequence per layer.
    decode = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=query.device)
        # Each row's pages from the first that holds a position of its window: gathered
        # position t of row i is position t + first_pages[i] * page_size of its sequence.
        first_pages = [window_start(seq_lens[i] - 1, window) // page_size for i in decode]
        ends = [
            seq_lens[i] - first * page_size for i, first in zip(decode, first_pages, strict=True)
        ]
        num_pages = ceil_div(max(ends), page_size)
        tables = _page_table_rows(meta.page_tables, decode, first_pages, num_pages)
        key, value = gather_context(cache, tables, query.dtype)
        positions = torch.arange(key.shape[1], device=query.device)
        lens = torch.tensor(ends, device=query.device)
        valid = positions[None, :] < lens[:, None]
        if window is not None:
            firsts = torch.tensor(
                [
                    seq_lens[i] - window - p * page_size
                    for i, p in zip(decode, first_pages, strict=True)
                ],
                device=query.device,
            )
            valid &= positions[None, :] >= firsts[:, None]
        # Slots past a sequence's end were never written and may hold NaN, which neither a
        # masked score nor a zero probability cancels (NaN - inf and 0 * NaN are NaN). Only
        # positions past the shortest sequence can be such slots.
        tail = min(ends)
        outside = ~valid[:, tail:, None, None]
        key[:, tail:].masked_fill_(outside, 0.0)
        value[:, tail:].masked_fill_(outside, 0.0)
        # A KV head's query heads share its keys and mask: fold them into the query length, so
        # one attention over num_kv_heads heads serves all of them.
        num_seqs, num_heads, head_dim = len(decode), query.shape[1], query.shape[2]
        num_kv_heads = key.shape[2]
        folded = query[rows].reshape(num_seqs, num_kv_heads, -1, head_dim)
        attended = F.scaled_dot_product_attention(
            folded,
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=softmax_scale,
        )
        out[rows] = attended.reshape(num_seqs, num_heads, head_dim)

    for i, q_len in enumerate(query_lens):
        if q_len == 1:
            continue
        rows = slice(starts[i], starts[i + 1])
        out[rows] = chunk_attention(
            query[rows], cache, meta.page_tables[i], seq_lens[i], softmax_scale, window
        )
    return out


def _page_table_rows(
    page_tables: torch.Tensor,  # [S, max_pages_per_seq] int32
    seqs: list[int],
    first_pages: list[int],
    num_pages: int,
) -> torch.Tensor:  # [len(seqs), num_pages] int64
    """Rows ``seqs`` of the page tables, each from its own first page on, ``num_pages`` wide.
    Columns past a table's width repeat its last entry: they lie past the sequence's end, whose
    slots the caller masks."""
    device = page_tables.device
    columns = torch.tensor(first_pages, device=device)[:, None] + torch.arange(
        num_pages, device=device
    )
    columns = columns.clamp_(max=page_tables.shape[1] - 1)
    return torch.gather(page_tables[torch.tensor(seqs, device=device)].long(), 1, columns)


def chunk_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the context
    cache: KVCacheView,
    page_table: torch.Tensor,  # [max_pages_per_seq] int32
    seq_len: int,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """One sequence's chunk of queries over its context: SDPA over its gathered pages (with a
    window, over the pages from the first that its first query attends to)."""
    if window is not None:
        first_page = window_start(seq_len - query.shape[0], window) // cache.page_size
        queries, keys, values = sequence_context(query, cache, page_table, seq_len, first_page)
        mask = sliding_causal_mask(
            query.shape[0], seq_len, first_page * cache.page_size, window, query.device
        )
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=softmax_scale, enable_gqa=True
        )
        return attended[0].transpose(0, 1)
    # Imported here: the module imports torch._dynamo, seconds of every worker's start-up that
    # only this path needs.
    from torch.nn.attention.bias import causal_lower_right

    queries, keys, values = sequence_context(query, cache, page_table, seq_len)
    # Lower-right causal alignment: the chunk's queries are the context's last q_len positions.
    attended = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=causal_lower_right(query.shape[0], seq_len),
        scale=softmax_scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


def sliding_causal_mask(
    q_len: int, seq_len: int, first_key: int, window: int, device: torch.device
) -> torch.Tensor:  # [q_len, seq_len - first_key] bool
    """Which keys, positions ``first_key ..`` of the context, each of its last ``q_len``
    positions attends to through a sliding ``window``."""
    queries = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    keys = torch.arange(first_key, seq_len, device=device)[None, :]
    return (keys <= queries) & (keys > queries - window)


def sequence_context(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    cache: KVCacheView,
    page_table: torch.Tensor,  # [max_pages_per_seq] int
    seq_len: int,
    first_page: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's queries and its keys and values gathered from its pages (in the query's
    dtype), those of positions ``first_page * page_size .. seq_len - 1``, in SDPA's layout:
    [1, heads, length, head_dim] each."""
    num_pages = ceil_div(seq_len, cache.page_size)
    length = seq_len - first_page * cache.page_size
    tables = page_table[None, first_page:num_pages].long()
    key, value = gather_context(cache, tables, query.dtype)
    return (
        query.transpose(0, 1)[None],
        key[0, :length].transpose(0, 1)[None],
        value[0, :length].transpose(0, 1)[None],
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        store_kv(key, value, cache, slot_mapping)

    def attention(self, query, cache, meta, softmax_scale, window=None) -> torch.Tensor:
        return paged_attention(query, cache, meta, softmax_scale, window)
