"""A prefill chunk's attention after a cached prefix, in two SDPA calls merged by log-sum-exp;
whole prompts of one length side by side, in one.

SDPA attends a chunk whose queries are the last rows of a longer context through an explicit
lower-right causal mask, and its CPU kernel computes every masked score before it drops it: for a
1024-token chunk after a 1024-token prefix a third of the work is thrown away. Split at the
prefix, the chunk's queries attend the prefix with no mask at all and the chunk's own keys with
SDPA's plain causal mask, which it skips block by block; the two partial softmaxes are then
weighed by their log-sum-exps. On the 2-core AMX Xeon (9 query heads, 3 KV heads, head_dim 64,
bf16) one layer took 10.6 ms against 17.0 ms for a 1024-token chunk after 1024 cached tokens.

The two partial outputs are each rounded to the query's dtype before the merge, so in bf16 this
rounds differently from one SDPA call; the torch backend's ``chunk_attention`` is its
twin, within the tolerance of one bf16 rounding. A chunk with no prefix is one call, the
torch backend's very bits.

Prompts that a step prefills whole, of one length and in consecutive rows (a batch of equal
prompts), attend as one batch of SDPA: one gather and one call instead of a dozen small torch
ops per prompt and layer, about 0.1 ms each (8 x 256 tokens on the Xeon: 4.4 -> 3.7 ms a layer).
SDPA attends each batch entry alone, so the bits are the one-prompt calls'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.interface import KVCacheView
from kernels.sizes import ceil_div
from kernels.torch_backend import (
    chunk_attention,
    gather_context,
    sequence_context,
    sliding_causal_mask,
)


def chunk_attention_after_prefix(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the context
    cache: KVCacheView,
    page_table: torch.Tensor,  # [max_pages_per_seq] int32
    seq_len: int,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """The torch backend's ``chunk_attention``, the cached prefix and the chunk attended apart;
    through a sliding window, that very call (one SDPA over the window's pages, masked)."""
    if window is not None:
        return chunk_attention(query, cache, page_table, seq_len, softmax_scale, window)
    prefix = seq_len - query.shape[0]
    queries, keys, values = sequence_context(query, cache, page_table, seq_len)
    if prefix == 0:
        # The torch backend's own call: its lower-right mask of a square is SDPA's causal mask,
        # which this names directly, without the mask object's Python dispatch.
        attended = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=softmax_scale, enable_gqa=True
        )
        return attended[0].transpose(0, 1)
    # The flash kernel itself: SDPA's wrapper does not return the log-sum-exps.
    attend = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past, past_lse = attend(
        queries, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False, scale=softmax_scale
    )
    own, own_lse = attend(
        queries, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True, scale=softmax_scale
    )
    # [1, num_heads, q_len] each: every query sees at least one key on both sides.
    total = torch.logaddexp(past_lse, own_lse)
    merged = past.float() * torch.exp(past_lse - total)[..., None]
    merged += own.float() * torch.exp(own_lse - total)[..., None]
    return merged[0].transpose(0, 1).to(query.dtype)


@dataclass(frozen=True)
class WholePrompts:
    """Prompts of ``length`` tokens, each prefilled whole in this step, in consecutive rows."""

    first_row: int
    length: int
    seqs: tuple[int, ...]  # their sequences in the step
    page_tables: torch.Tensor  # [num_prompts, max_pages_per_seq] int64, their rows

    @property
    def num_prompts(self) -> int:
        return len(self.seqs)

    @property
    def end_row(self) -> int:
        return self.first_row + self.num_prompts * self.length


def whole_prompts(
    long_chunks: tuple[tuple[int, int, int, int], ...],  # (seq, first row, end row, seq_len)
    page_tables: torch.Tensor,  # [num_seqs, max_pages_per_seq] int32
) -> tuple[WholePrompts, ...]:
    """The runs of two or more chunks that are whole prompts of one length in consecutive rows."""
    runs: list[list[tuple[int, int, int, int]]] = []
    for chunk in long_chunks:
        _, start, end, seq_len = chunk
        if seq_len != end - start:  # a cached prefix
            continue
        previous = runs[-1][-1] if runs else None
        if previous is not None and previous[2] == start and previous[3] == seq_len:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    groups = []
    for run in runs:
        if len(run) < 2:
            continue
        seqs = tuple(chunk[0] for chunk in run)
        tables = page_tables[list(seqs)].long()
        groups.append(WholePrompts(run[0][1], run[0][3], seqs, tables))
    return tuple(groups)


def whole_prompts_attention(
    query: torch.Tensor,  # [num_prompts * length, num_heads, head_dim], the prompts' rows
    cache: KVCacheView,
    prompts: WholePrompts,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [num_prompts * length, num_heads, head_dim]
    """Each prompt's causal attention over its own keys (through a sliding ``window``, where
    given), the prompts as one SDPA batch."""
    count, length = prompts.num_prompts, prompts.length
    tables = prompts.page_tables[:, : ceil_div(length, cache.page_size)]
    key, value = gather_context(cache, tables, query.dtype)
    queries = query.view(count, length, *query.shape[1:]).transpose(1, 2)
    mask = None
    if window is not None:
        mask = sliding_causal_mask(length, length, 0, window, query.device)
    attended = F.scaled_dot_product_attention(
        queries,
        key[:, :length].transpose(1, 2),
        value[:, :length].transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=softmax_scale,
        enable_gqa=True,
    )  # [count, num_heads, length, head_dim]
    return attended.transpose(1, 2).reshape(query.shape)
