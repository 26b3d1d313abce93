"""Pieces shared by the Triton kernels that read or write the paged KV pool.

The Python half checks a ``KVCacheView`` once and hands its strides to a kernel; the Triton half
is the page lookup and the online-softmax step over one tile of keys, which the prefill and the
decode kernels both run.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interface import (
    FP8_DTYPE,
    INT8_DTYPE,
    INT8_SCALE_BITS_BASE,
    INT8_SCALE_DTYPE,
    AttentionMetadata,
    KVCacheView,
    check_window,
)
from kernels.sizes import next_power_of_2

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Quantised page dtypes: the kernels' KV_QUANT flag ("none" for pages in an activation dtype)
# and the dtype of the one scale per (token, head) that travels with the pages.
QUANTIZED = {FP8_DTYPE: ("fp8", torch.float32), INT8_DTYPE: ("int8", INT8_SCALE_DTYPE)}
CACHE_DTYPES = (*ACTIVATION_DTYPES, *QUANTIZED)

# exp2 is the native instruction; folding log2(e) into the softmax scale costs nothing.
LOG2E = 1.4426950408889634
# Globals read inside a kernel must be constexpr.
_INT8_SCALE_BITS_BASE = tl.constexpr(INT8_SCALE_BITS_BASE)
# The window the kernels take for a layer without one: wider than any context, so that
# ``position - window`` is below every key and still an int32.
NO_WINDOW = 2**31 - 1


def kernel_window(window: int | None) -> int:
    """A layer's sliding window as the kernels take it (``NO_WINDOW`` for none)."""
    check_window(window)
    return NO_WINDOW if window is None else window


@dataclass(frozen=True)
class CacheArgs:
    """A checked ``KVCacheView`` flattened into what the kernels take."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None
    kv_quant: str  # "none", "fp8" or "int8": the kernels' KV_QUANT flag
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_strides: tuple[int, int, int]  # page, slot, head (the dim stride is 1)
    scale_strides: tuple[int, int, int]  # page, slot, head; zeros when not quantised

    @property
    def is_quantized(self) -> bool:
        return self.kv_quant != "none"

    def scale_pointers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value scales to hand a kernel. Unquantised kernels never dereference
        their scale pointers, so the pages stand in for them."""
        if self.key_scale is None or self.value_scale is None:
            return self.key, self.value
        return self.key_scale, self.value_scale


# Every launch over a layer's pages checks its view (the store and attention, each layer of each
# step) and a view lives as long as its pool: it is checked and flattened once, at 11 us a time
# on the host, which an eager step on a GPU waits on.
_CHECKED_CACHES: weakref.WeakKeyDictionary[KVCacheView, CacheArgs] = weakref.WeakKeyDictionary()


def check_cache(cache: KVCacheView, device: torch.device) -> CacheArgs:
    """Validate one layer's view of the pool; raise ``ValueError`` on anything a kernel can't read.

    K and V must share a layout (they are two views of one pool), so the kernels take one set of
    strides for both; the same holds for the two scale views.
    """
    args = _CHECKED_CACHES.get(cache)
    if args is None:
        args = _flattened_cache(cache)
        _CHECKED_CACHES[cache] = args
    if args.key.device != device:
        raise ValueError(f"cache is on {args.key.device}, inputs on {device}")
    return args


def _flattened_cache(cache: KVCacheView) -> CacheArgs:
    key, value = cache.key, cache.value
    if key.dim() != 4 or key.shape != value.shape:
        raise ValueError(
            f"cache key/value must both be [num_pages, page_size, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != value.dtype or key.dtype not in CACHE_DTYPES:
        raise ValueError(f"unsupported cache dtypes {key.dtype}/{value.dtype}")
    if key.stride() != value.stride() or key.stride(-1) != 1:
        raise ValueError(
            f"cache key/value need equal strides and a unit head_dim stride, "
            f"got {key.stride()} and {value.stride()}"
        )
    if value.device != key.device:
        raise ValueError(f"cache values are on {value.device}, its keys on {key.device}")

    kv_quant, scale_dtype = QUANTIZED.get(key.dtype, ("none", None))
    scale_strides = (0, 0, 0)
    if scale_dtype is not None:
        k_scale, v_scale = cache.key_scale, cache.value_scale
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {key.dtype} cache needs key_scale and value_scale")
        for scale in (k_scale, v_scale):
            if scale.dtype != scale_dtype or scale.shape != key.shape[:3]:
                raise ValueError(
                    f"the scales of a {key.dtype} cache must be {scale_dtype} "
                    f"{tuple(key.shape[:3])}, got {scale.dtype} {tuple(scale.shape)}"
                )
            if scale.device != key.device:
                raise ValueError(f"cache scales are on {scale.device}, its pages on {key.device}")
        if k_scale.stride() != v_scale.stride():
            raise ValueError(f"scale strides differ: {k_scale.stride()} vs {v_scale.stride()}")
        scale_strides = (k_scale.stride(0), k_scale.stride(1), k_scale.stride(2))
    elif cache.key_scale is not None or cache.value_scale is not None:
        raise ValueError(f"scales are only meaningful for an FP8 or int8 cache, not {key.dtype}")

    return CacheArgs(
        key=key,
        value=value,
        key_scale=cache.key_scale,
        value_scale=cache.value_scale,
        kv_quant=kv_quant,
        page_size=key.shape[1],
        num_kv_heads=key.shape[2],
        head_dim=key.shape[3],
        kv_strides=(key.stride(0), key.stride(1), key.stride(2)),
        scale_strides=scale_strides,
    )


@functools.cache
def _check_fp8_supported(device: torch.device) -> None:
    # Triton has no e4m3 type before Ada/Hopper, and the attention kernels convert e4m3 natively;
    # failing here beats a compiler error in the middle of a forward.
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "FP8 KV with the Triton kernels needs compute capability 8.9 or newer; "
            "use a bf16/fp16 cache on this GPU"
        )


def check_query(query: torch.Tensor, cache: CacheArgs) -> int:
    """Validate ``query [N, num_heads, head_dim]`` against the cache; return the GQA group size."""
    if query.dim() != 3 or query.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"query must be [N, num_heads, head_dim] fp16/bf16/fp32, "
            f"got {query.dtype} {tuple(query.shape)}"
        )
    if query.stride(-1) != 1:
        raise ValueError(f"query needs a unit head_dim stride, got strides {query.stride()}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    if head_dim != cache.head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache.head_dim}")
    if num_heads % cache.num_kv_heads != 0:
        raise ValueError(
            f"num_heads {num_heads} is not a multiple of num_kv_heads {cache.num_kv_heads}"
        )
    if cache.kv_quant == "fp8":
        _check_fp8_supported(query.device)
    elif cache.kv_quant == "none" and cache.key.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the cache is {cache.key.dtype}")
    return num_heads // cache.num_kv_heads


def check_metadata(meta: AttentionMetadata, device: torch.device) -> None:
    """Validate the index tensors (not their values: that would cost a host sync)."""
    num_seqs = meta.num_seqs
    expected = {
        "query_start_loc": (meta.query_start_loc, 1),
        "seq_lens": (meta.seq_lens, 1),
        "page_tables": (meta.page_tables, 2),
    }
    for name, (tensor, ndim) in expected.items():
        if tensor.dtype != torch.int32 or tensor.dim() != ndim or tensor.device != device:
            raise ValueError(
                f"{name} must be a {ndim}-d int32 tensor on {device}, "
                f"got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )
    if meta.query_start_loc.shape[0] != num_seqs + 1 or meta.page_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc needs {num_seqs + 1} entries and page_tables {num_seqs} rows, "
            f"got {tuple(meta.query_start_loc.shape)} and {tuple(meta.page_tables.shape)}"
        )
    if meta.page_tables.stride(1) != 1 or meta.query_start_loc.stride(0) != 1:
        raise ValueError("page_tables rows and query_start_loc must be contiguous")
    if meta.seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous")


def check_softmax_scale(softmax_scale: float) -> None:
    # attend_tile scales a row's max instead of every score, which is exact for a positive scale
    # only (a negative one would turn the max into the min).
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")


def head_block(head_dim: int) -> int:
    # tl.dot needs every tile side >= 16; a head_dim of 80 or 96 pads to the next power of two.
    return max(16, next_power_of_2(head_dim))


@triton.jit
def page_slots(page_table_ptr, positions, mask, page_size):
    """Page id (int64) and in-page slot of each context position of one sequence.

    The page id is widened before any multiplication: page id x page stride overflows int32 in a
    pool of a few GiB.
    """
    page = tl.load(page_table_ptr + positions // page_size, mask=mask, other=0)
    return page.to(tl.int64), positions % page_size


@triton.jit
def int8_scale(code):
    """float32 scales of one-byte int8 scale codes (any integer type): their bits, not an exp2,
    so every backend decodes them alike (``kv_formats.int8_scale``)."""
    return ((code.to(tl.int32) << 20) + _INT8_SCALE_BITS_BASE).to(tl.float32, bitcast=True)


@triton.jit
def _load_scale(ptr, mask, KV_QUANT: tl.constexpr):
    """float32 scales of a quantised cache: stored as they are for FP8, as codes for int8.
    One return after an if/else on the constexpr: compiled Triton (unlike its interpreter) types
    every return of a function, also one past a constexpr branch that returned, and an int8
    cache's uint8 codes there clash with the float32 scale."""
    if KV_QUANT == "int8":
        scale = int8_scale(tl.load(ptr, mask=mask, other=0))
    else:
        scale = tl.load(ptr, mask=mask, other=0.0)
    return scale


@triton.jit
def attend_tile(
    q,  # [M, BLOCK_D] query rows, in the query's dtype
    acc,  # [M, BLOCK_D] float32, unnormalised output so far
    m_i,  # [M] float32, running max of the log2-scaled scores
    l_i,  # [M] float32, running softmax denominator
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], at this KV head
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], at this KV head
    k_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this KV head
    v_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this KV head
    page,  # [BLOCK_N] int64 page id of each key
    slot,  # [BLOCK_N] slot of each key within its page
    kv_mask,  # [BLOCK_N] key exists (masked keys are never read: unwritten slots may hold NaN)
    allowed,  # [M, BLOCK_N] query row may attend to key
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    stride_kv_page,
    stride_kv_slot,
    stride_scale_page,
    stride_scale_slot,
    qk_scale,  # softmax scale * log2(e)
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
    MASKED: tl.constexpr,  # False: every key exists and every row may see it, so the K/V
    # loads and the scores skip their masks (``allowed`` is not read): same sums, fewer ops
):
    """One FlashAttention-2 step: fold a tile of keys/values into the running softmax state.

    Both kinds of tile (``MASKED`` or not) do the same float arithmetic on every score, so a key
    tile gives a row the same bits whichever kind it is, and a position's output does not
    depend on how a step was cut. The mask only swaps a score for -inf before anything is
    computed from it. The exponent is an explicit ``fma`` and the row max is scaled once per
    row: left as ``scores * qk_scale - m``, the compiler fuses the multiply into the subtraction
    wherever nothing stands between them (the unmasked tiles) and not where a select does (the
    masked ones), and the two round differently (float32 queries showed it on an H200).
    ``benchmarks.step.compiled_kernels --contraction`` checks that no such pair is left.

    A row may see no key of a tile and none before it (the rows of a prefill tile through a
    sliding window start at different keys): its max stays -inf, and ``0`` stands in for it in
    the exponents, so the tile adds exact zeros instead of ``exp2(fma(-inf, s, inf))``, NaN.
    A row with a finite max computes with that max itself, bit for bit.
    """
    kv_offsets = page * stride_kv_page + slot * stride_kv_slot
    tile_mask = kv_mask[:, None] & d_mask[None, :] if MASKED else d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets[:, None] + offs_d[None, :], mask=tile_mask, other=0.0)
    # "ieee" only matters for float32 operands, where TF32 would be less exact than the reference.
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    if KV_QUANT != "none":
        # The scale is constant along head_dim, so it factors out of q.k: e4m3 and int8 values
        # convert exactly to fp16/bf16, and the scale is applied to the float32 score.
        scale_offsets = page * stride_scale_page + slot * stride_scale_slot
        k_scale = _load_scale(k_scale_ptr + scale_offsets, kv_mask, KV_QUANT)
        scores = scores * k_scale[None, :]
    if MASKED:
        scores = tl.where(allowed, scores, float("-inf"))

    # qk_scale > 0 and rounding is monotonic, so scaling the row's max scales its largest score
    # exactly as scaling every score would: one multiply per row instead of one per score.
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(tl.fma(scores, qk_scale, -m_sub[:, None]))
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))

    v = tl.load(v_cache_ptr + kv_offsets[:, None] + offs_d[None, :], mask=tile_mask, other=0.0)
    if KV_QUANT != "none":
        # V's scale varies along the reduction axis of p @ v. Folded into p it costs a multiply
        # per score instead of one per element of V, but with fp16 operands it would push small
        # probabilities into subnormals: there V is dequantised instead.
        v_scale = _load_scale(v_scale_ptr + scale_offsets, kv_mask, KV_QUANT)
        if q.dtype == tl.float16:
            v = v.to(tl.float32) * v_scale[:, None]
        else:
            p = p * v_scale[None, :]
    # The rescaled accumulator is the dot's own: the tensor cores add p @ v to it in place.
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attend_span(
    q,  # [M, BLOCK_D] query rows, in the query's dtype
    acc,  # [M, BLOCK_D] float32, unnormalised output so far
    m_i,  # [M] float32, running max of the log2-scaled scores
    l_i,  # [M] float32, running softmax denominator
    k_cache_ptr,  # at this KV head, as attend_tile takes it
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    page_table_ptr,  # this sequence's row of the page table
    first,  # the span's first key
    unmasked_end,  # first + a multiple of BLOCK_N: the tiles before it need no mask
    end,  # one past the span's last key
    begin,  # the first key the masked tiles read: keys before it are never loaded
    query_pos,  # [M] context position of each query row (read when CAUSAL)
    window,  # a row sees keys past query_pos - window only (read when CAUSAL; NO_WINDOW: all)
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    page_size,
    stride_kv_page,
    stride_kv_slot,
    stride_scale_page,
    stride_scale_slot,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
    CAUSAL: tl.constexpr,  # mask keys past each row's query position
):
    """Fold keys ``[first, end)`` of one sequence into the softmax state, ``BLOCK_N`` at a time
    from ``first``. The tiles before ``unmasked_end`` skip the masks; the rest mask keys before
    ``begin`` or at or past ``end`` (never loading them: their pages may be gone) and, when
    ``CAUSAL``, those past each row's query or not past its ``query_pos - window``. The tiles
    and their order do not depend on where the unmasked ones end, so neither do the sums.

    Each iteration reads the page ids of the next tile, not its own: its K/V loads take their
    addresses from the iteration before. Where a tile's K/V loads wait on a page-table load of
    their own iteration, Triton's software pipeliner keeps them only one tile ahead whatever
    ``num_stages`` (compiled for sm_90, every wait in the loop is for all copies in flight); with
    the ids a step ahead, ``num_stages`` 3 and 4 keep 2 and 3 tiles of K/V in flight
    (``benchmarks.step.compiled_kernels`` shows the IR)."""
    pos = first + tl.arange(0, BLOCK_N)
    page, slot = page_slots(page_table_ptr, pos, pos < end, page_size)
    for start in range(first, unmasked_end, BLOCK_N):
        kv_mask = start + tl.arange(0, BLOCK_N) < end
        next_pos = start + BLOCK_N + tl.arange(0, BLOCK_N)
        next_page, next_slot = page_slots(page_table_ptr, next_pos, next_pos < end, page_size)
        acc, m_i, l_i = attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            page,
            slot,
            kv_mask,
            kv_mask[None, :],
            offs_d,
            d_mask,
            stride_kv_page,
            stride_kv_slot,
            stride_scale_page,
            stride_scale_slot,
            qk_scale,
            KV_QUANT,
            MASKED=False,
        )
        page, slot = next_page, next_slot
    # The first loop leaves the ids of the tile at unmasked_end (or at first, where it ran no
    # tile: then unmasked_end == first).
    for start in range(unmasked_end, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        kv_mask = (pos < end) & (pos >= begin)
        next_pos = pos + BLOCK_N
        next_page, next_slot = page_slots(page_table_ptr, next_pos, next_pos < end, page_size)
        causal = pos[None, :] <= query_pos[:, None]
        causal &= pos[None, :] > query_pos[:, None] - window
        allowed = causal & kv_mask[None, :] if CAUSAL else kv_mask[None, :]
        acc, m_i, l_i = attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            page,
            slot,
            kv_mask,
            allowed,
            offs_d,
            d_mask,
            stride_kv_page,
            stride_kv_slot,
            stride_scale_page,
            stride_scale_slot,
            qk_scale,
            KV_QUANT,
            MASKED=True,
        )
        page, slot = next_page, next_slot
    return acc, m_i, l_i
