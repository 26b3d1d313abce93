"""The kernels' oracle: the paged KV store and attention written plainly, slot by slot and
position by position, so that every backend, the portable torch one included, is tested against
code it does not share. What the twins do share is the definition of the 8-bit formats
(``kernels/kv_formats.py``), which the stores are also checked against bit for bit, and SDPA for
the softmax: attention in the query's dtype, as the torch backend computes it.

Twins of one backend's own rounding (the CPU's bf16 pair scores and its AMX prefill blocks) sit
here too: tests are their only users.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.interface import AttentionMetadata, KVCacheView
from kernels.kv_formats import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8


def store_kv_twin(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,  # [N, num_kv_heads, head_dim]
    cache: KVCacheView,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """Token ``n``'s key and value into slot ``slot_mapping[n]``, one token at a time."""
    for row, slot in enumerate(slot_mapping.tolist()):
        page, offset = divmod(slot, cache.page_size)
        for new, pages, scales in (
            (key[row], cache.key, cache.key_scale),
            (value[row], cache.value, cache.value_scale),
        ):
            if not cache.is_quantized:
                pages[page, offset] = new.to(pages.dtype)
                continue
            assert scales is not None
            quantized, scale = quantize_fp8(new) if cache.is_fp8 else quantize_int8(new)
            # Byte for byte: not every device indexes float8 tensors.
            pages[page, offset].view(torch.uint8).copy_(quantized.view(torch.uint8))
            scales[page, offset] = scale


def context_twin(
    cache: KVCacheView,
    page_table: torch.Tensor,
    seq_len: int,
    dtype: torch.dtype,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [seq_len - first, num_kv_heads, head_dim]
    """A sequence's keys and values from position ``first`` on, read position by position
    through its page table."""
    pages = page_table.tolist()
    keys, values = [], []
    for position in range(first, seq_len):
        page, offset = pages[position // cache.page_size], position % cache.page_size
        for stored, scales, out in (
            (cache.key, cache.key_scale, keys),
            (cache.value, cache.value_scale, values),
        ):
            vector = stored[page, offset]
            if cache.is_quantized:
                assert scales is not None
                dequantize = dequantize_fp8 if cache.is_fp8 else dequantize_int8
                vector = dequantize(vector, scales[page, offset])
            out.append(vector.to(dtype))
    return torch.stack(keys), torch.stack(values)


def paged_attention_twin(
    query: torch.Tensor,  # [N, num_heads, head_dim]
    cache: KVCacheView,
    meta: AttentionMetadata,
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim]
    """Each sequence's queries, the last rows of its context, attend causally to it: with a
    sliding ``window``, the query at position p to positions p - window < j <= p only, read
    from the first of them on (so pages before it are never read)."""
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        q_len = starts[i + 1] - starts[i]
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        key, value = context_twin(cache, meta.page_tables[i], seq_len, query.dtype, first)
        out[rows] = attend_twin(query[rows], key, value, softmax_scale, window)
    return out


def attend_twin(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the context's last q_len positions
    key: torch.Tensor,  # [length, num_kv_heads, head_dim], the context's last positions
    value: torch.Tensor,  # [length, num_kv_heads, head_dim]
    softmax_scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, length = query.shape[0], key.shape[0]
    positions = torch.arange(length - q_len, length, device=query.device)
    keys = torch.arange(length, device=query.device)[None, :]
    seen = keys <= positions[:, None]
    if window is not None:
        seen &= keys > positions[:, None] - window
    group = query.shape[1] // key.shape[1]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.repeat_interleave(group, dim=1).transpose(0, 1),
        value.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=seen,
        scale=softmax_scale,
    )
    return attended.transpose(0, 1)


def bf16_pair_scores(
    query: torch.Tensor,  # [head_dim] bf16
    keys: torch.Tensor,  # [T, head_dim] bf16
    softmax_scale: float,
) -> torch.Tensor:  # [T] float32
    """The CPU attention's scores over bf16 pages where it multiplies bf16 pairs (vdpbf16ps,
    ``kernels/cpu/paged_attention.c``), bit for bit: lane i of each 32-value chunk adds the
    product of elements 2i+1, then that of 2i, chunk after chunk (each product exact in
    float32, each add rounded); lanes 4k..4k+3 sum as (l0 + l2) + (l1 + l3) into four block
    sums, which sum as (b0 + b1) + (b2 + b3); the sum is multiplied by the scale. (The
    instruction reads and writes denormals as zero, which this twin does not: its tests keep
    away from them.)"""
    head_dim = query.shape[-1]
    products = (query.float() * keys.float()).view(-1, head_dim // 32, 16, 2)
    lanes = torch.zeros(keys.shape[0], 16)
    for chunk in range(head_dim // 32):
        lanes = lanes + products[:, chunk, :, 1]
        lanes = lanes + products[:, chunk, :, 0]
    blocks = lanes.view(-1, 4, 4)
    block_sums = (blocks[..., 0] + blocks[..., 2]) + (blocks[..., 1] + blocks[..., 3])
    total = (block_sums[:, 0] + block_sums[:, 1]) + (block_sums[:, 2] + block_sums[:, 3])
    return total * softmax_scale


# Keys per step of the AMX prefill kernel's online softmax (kernels/cpu/prefill_attention.c).
PREFILL_KEY_BLOCK = 64


def prefill_attention_blocks_reference(
    query: torch.Tensor,  # [q_len, num_heads, head_dim] bf16, the last q_len positions
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] bf16
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] bf16
    softmax_scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] bf16
    """The AMX prefill kernel's causal attention, its blocks and roundings: keys in blocks of
    PREFILL_KEY_BLOCK from key 0, float32 scores; per row a running max over the keys it sees,
    each block's probabilities ``exp(score * scale - max)`` rounded to bf16, their running sum,
    and the output's running float32 sum of those probabilities times the values, both scaled by
    ``exp(old max - new max)`` where the max grew; the output divided by the sum, rounded to bf16.
    The kernel sums its products and its probabilities in another order and its exp is within 2
    ulp of torch's, so the two agree to a bf16 rounding now and then, not bit for bit."""
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    queries = query.float().transpose(0, 1)  # [num_heads, q_len, head_dim]
    keys = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    positions = torch.arange(seq_len - q_len, seq_len)
    running_max = torch.full((num_heads, q_len, 1), -torch.inf)
    running_sum = torch.zeros(num_heads, q_len, 1)
    out = torch.zeros(num_heads, q_len, head_dim)
    for first in range(0, seq_len, PREFILL_KEY_BLOCK):
        block = slice(first, min(first + PREFILL_KEY_BLOCK, seq_len))
        scores = (queries @ keys[:, block].transpose(1, 2)) * softmax_scale
        seen = torch.arange(block.start, block.stop)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~seen, -torch.inf)
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        grew = new_max > running_max
        rescale = torch.where(grew, torch.exp(running_max - new_max), torch.ones(()))
        running_sum = running_sum * rescale
        out = out * rescale
        running_max = new_max
        # A row that sees none of the block keeps its max at -inf only before its first key,
        # which every row sees in block 0; exp(-inf - max) is 0 for the keys it does not see.
        probs = torch.exp(scores - running_max).bfloat16().float()
        running_sum = running_sum + probs.sum(dim=-1, keepdim=True)
        out = out + probs @ values[:, block]
    return (out / running_sum).transpose(0, 1).bfloat16()
