"""Plain-torch twins of the Triton kernels: the CPU production path and the tests' ground truth.

Each function here states the exact semantics its Triton twin must reproduce (see
``kernels/interface.py`` for the batch layout). Attention runs through SDPA in the
query's dtype; its CPU kernels accumulate scores and softmax in float32.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.interface import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    INT8_DTYPE,
    INT8_MAX,
    INT8_SCALE_BITS_BASE,
    INT8_SCALE_DTYPE,
    AttentionBackend,
    AttentionMetadata,
    KVCacheView,
)
from kernels.sizes import ceil_div


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to e4m3 with one float32 scale per vector."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    quantized = (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale.unsqueeze(-1)


def int8_scale_code(amax: torch.Tensor) -> torch.Tensor:
    """The code of the smallest one-byte scale ``s`` with ``127 * s >= amax`` (float32 ``amax``):
    positive floats order like their bits, so it is the ceiling of the bits over 2**20."""
    bits = (amax / INT8_MAX).view(torch.int32).long()
    code = torch.div(bits - INT8_SCALE_BITS_BASE + (1 << 20) - 1, 1 << 20, rounding_mode="floor")
    return code.clamp(0, 255).to(INT8_SCALE_DTYPE)


def int8_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 scales of one-byte codes, exactly as every kernel decodes them."""
    return ((code.to(torch.int32) << 20) + INT8_SCALE_BITS_BASE).view(torch.float32)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to int8 with one one-byte scale code per vector. Rounds half
    up (``floor(y + 0.5)``): exact in float32 for ``|y| <= 127`` and the same in every kernel."""
    x32 = x.float()
    code = int8_scale_code(x32.abs().amax(dim=-1))
    scaled = torch.floor(x32 / int8_scale(code).unsqueeze(-1) + 0.5)
    return scaled.clamp(-INT8_MAX, INT8_MAX).to(INT8_DTYPE), code


def dequantize_int8(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return x.float() * int8_scale(code).unsqueeze(-1)


def store_kv_reference(
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


def paged_attention_reference(
    query: torch.Tensor,  # [N, num_heads, head_dim]
    cache: KVCacheView,
    meta: AttentionMetadata,
    softmax_scale: float,
) -> torch.Tensor:  # [N, num_heads, head_dim]
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
        lens = torch.tensor([seq_lens[i] for i in decode], device=query.device)
        num_pages = ceil_div(max(seq_lens[i] for i in decode), page_size)
        tables = meta.page_tables[torch.tensor(decode, device=query.device), :num_pages]
        key, value = gather_context(cache, tables.long(), query.dtype)
        positions = torch.arange(key.shape[1], device=query.device)
        valid = positions[None, :] < lens[:, None]
        # Slots past a sequence's end were never written and may hold NaN, which neither a
        # masked score nor a zero probability cancels (NaN - inf and 0 * NaN are NaN). Only
        # positions past the shortest sequence can be such slots.
        tail = min(seq_lens[i] for i in decode)
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
        out[rows] = chunk_attention_reference(
            query[rows], cache, meta.page_tables[i], seq_lens[i], softmax_scale
        )
    return out


def chunk_attention_reference(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the context
    cache: KVCacheView,
    page_table: torch.Tensor,  # [max_pages_per_seq] int32
    seq_len: int,
    softmax_scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """One sequence's chunk of queries over its context: SDPA over its gathered pages."""
    # Imported here: the module imports torch._dynamo, seconds of every worker's start-up that
    # only this reference needs.
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


def sequence_context(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    cache: KVCacheView,
    page_table: torch.Tensor,  # [max_pages_per_seq] int
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's queries and its ``seq_len`` keys and values gathered from its pages (in the
    query's dtype), in SDPA's layout: [1, heads, length, head_dim] each."""
    num_pages = ceil_div(seq_len, cache.page_size)
    key, value = gather_context(cache, page_table[None, :num_pages].long(), query.dtype)
    return (
        query.transpose(0, 1)[None],
        key[0, :seq_len].transpose(0, 1)[None],
        value[0, :seq_len].transpose(0, 1)[None],
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        store_kv_reference(key, value, cache, slot_mapping)

    def attention(self, query, cache, meta, softmax_scale) -> torch.Tensor:
        return paged_attention_reference(query, cache, meta, softmax_scale)


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
