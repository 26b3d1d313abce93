"""KV store: write a step's new keys and values into their pages, quantising to FP8 or int8.

``rotate_and_store_kv`` also rotates the step's queries and keys by RoPE on the way, as
``kernels/triton/elementwise.py``'s kernel does: on CUDA that is one launch a layer where RoPE and
the store took three (RoPE on the queries, on the keys, then the store), and a small model's decode
step is mostly launches.

Twins: the formats of ``kernels/kv_formats.py`` and ``tests/kernel_twins.py``'s store; for the
rotation, ``common.model.llama``'s ``apply_rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interface import FP8_MAX, FP8_MIN_SCALE, INT8_MAX, INT8_SCALE_BITS_BASE, KVCacheView
from kernels.sizes import next_power_of_2
from kernels.triton.elementwise import load_half_angles, rotate_in_place, rotated_halves
from kernels.triton.paged import ACTIVATION_DTYPES, check_cache, int8_scale

# Globals read inside a kernel must be constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
_INT8_MAX = tl.constexpr(INT8_MAX)
_INT8_SCALE_BITS_BASE = tl.constexpr(INT8_SCALE_BITS_BASE)


@triton.jit
def _e4m3_bits(x):
    """Round float32 ``x`` (finite, ``|x| <= 448``) to nearest-even e4m3fn; return its byte.

    Written with integer ops rather than ``x.to(tl.float8e4nv)``: Triton 3.9's interpreter drops
    the carry when rounding overflows the mantissa (124.4 becomes 64, not 128). Integer ops round
    the same on every backend, so the pages match the torch reference byte for byte.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): round the 23-bit mantissa to 3 bits, half to even; a carry
    # runs on into the exponent, which is then rebiased from 127 to 7.
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: adding 2^14 leaves a float32 ulp of 2^-9, the e4m3 subnormal step, so the
    # hardware's round-to-nearest-even does the rounding and the low bits are the code.
    subnormal = (tl.abs(x) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000 is 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def _int8_scale_code(amax):
    """The code (int32, 0..255) of the smallest one-byte scale ``s`` with ``127 * s >= amax``.

    Positive floats order like their bits, so the code is the ceiling of ``(bits(amax / 127) -
    base) / 2**20``, clamped. The sum stays within int32 for every non-negative float32, and the
    arithmetic shift floors a negative sum as the reference's floor division does.
    """
    bits = tl.math.div_rn(amax, _INT8_MAX).to(tl.int32, bitcast=True)
    code = (bits - _INT8_SCALE_BITS_BASE + ((1 << 20) - 1)) >> 20
    return tl.minimum(tl.maximum(code, 0), 255)


@triton.jit
def _store_head_scales(
    amax,  # [BLOCK_H] float32: each head vector's largest magnitude
    scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this slot
    offs_h,
    h_mask,
    stride_scale_head,
    KV_QUANT: tl.constexpr,  # "fp8" or "int8"
):
    """Each head vector's scale into the pages' scales, returned for _store_scaled: the float32
    scale of FP8 pages, the one-byte code (int32) of int8 pages. div_rn: a plain fp32 division
    may be approximate on GPU, and the scales must match the reference bit for bit."""
    if KV_QUANT == "fp8":
        scales = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP8_MIN_SCALE)
        tl.store(scale_ptr + offs_h * stride_scale_head, scales, mask=h_mask)
    else:
        scales = _int8_scale_code(amax)
        tl.store(scale_ptr + offs_h * stride_scale_head, scales.to(tl.uint8), mask=h_mask)
    return scales


@triton.jit
def _store_scaled(
    x,  # [BLOCK_H, BLOCK]: some of one token's head vectors' elements, in the activations' dtype
    cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] at this slot; uint8 if FP8
    offsets,  # [BLOCK_H, BLOCK]: the elements' places from cache_ptr
    mask,  # [BLOCK_H, BLOCK]
    scales,  # [BLOCK_H] from _store_head_scales; unread for pages in an activation dtype
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    if KV_QUANT == "fp8":
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scales[:, None]), -_FP8_MAX, _FP8_MAX)
        tl.store(cache_ptr + offsets, _e4m3_bits(y), mask=mask)
    elif KV_QUANT == "int8":
        # Half up, floor(y + 0.5) in float32, exactly as the reference rounds.
        y = tl.floor(tl.math.div_rn(x.to(tl.float32), int8_scale(scales)[:, None]) + 0.5)
        tl.store(cache_ptr + offsets, tl.clamp(y, -_INT8_MAX, _INT8_MAX).to(tl.int8), mask=mask)
    else:
        tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_one(
    src_ptr,  # [heads, head_dim] at one token, unit stride within a head
    cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] at this slot; uint8 if FP8
    scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this slot
    stride_src_head,
    stride_kv_head,
    stride_scale_head,
    offs_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_D]
    h_mask,  # [BLOCK_H]
    mask,  # [BLOCK_H, BLOCK_D]
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    """One token's head vectors as they are into the pages."""
    x = tl.load(src_ptr + offs_h[:, None] * stride_src_head + offs_d[None, :], mask=mask, other=0.0)
    if KV_QUANT == "none":
        scales = 0.0
    else:
        amax = tl.max(tl.abs(x.to(tl.float32)), 1)
        scales = _store_head_scales(amax, scale_ptr, offs_h, h_mask, stride_scale_head, KV_QUANT)
    offsets = offs_h[:, None] * stride_kv_head + offs_d[None, :]
    _store_scaled(x, cache_ptr, offsets, mask, scales, KV_QUANT)


@triton.jit
def _store_one_rotated(
    src_ptr,  # [heads, head_dim] at one token, unit stride within a head
    cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] at this slot; uint8 if FP8
    scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this slot
    stride_src_head,
    stride_kv_head,
    stride_scale_head,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    offs_h,  # [BLOCK_H]
    offs_half,  # [BLOCK_HALF]
    h_mask,  # [BLOCK_H]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """One token's head vectors rotated by RoPE into the pages, as two halves; a head's scale
    comes from both."""
    x1, x2 = rotated_halves(src_ptr, stride_src_head, cos, sin, offs_h, offs_half, mask, HALF)
    if KV_QUANT == "none":
        scales = 0.0
    else:
        amax1 = tl.max(tl.abs(x1.to(tl.float32)), 1)
        amax2 = tl.max(tl.abs(x2.to(tl.float32)), 1)
        amax = tl.maximum(amax1, amax2)
        scales = _store_head_scales(amax, scale_ptr, offs_h, h_mask, stride_scale_head, KV_QUANT)
    offsets = offs_h[:, None] * stride_kv_head + offs_half[None, :]
    _store_scaled(x1, cache_ptr, offsets, mask, scales, KV_QUANT)
    _store_scaled(x2, cache_ptr, offsets + HALF, mask, scales, KV_QUANT)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [N, num_kv_heads, head_dim]
    value_ptr,  # [N, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided; uint8 if FP8
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided; uint8 if FP8
    k_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    v_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    slot_mapping_ptr,  # [N] int64
    query_ptr,  # ROTATE: [N, num_heads, head_dim], rotated in place
    cos_ptr,  # ROTATE: [N, head_dim] (its two halves equal)
    sin_ptr,  # ROTATE: [N, head_dim]
    page_size,
    num_kv_heads,
    num_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_query_token,
    stride_query_head,
    stride_angle,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    stride_scale_page,
    stride_scale_slot,
    stride_scale_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_QH: tl.constexpr,  # ROTATE: query heads rotated at a time
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # ROTATE: a power of two of at least head_dim / 2
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
    ROTATE: tl.constexpr,  # RoPE on the queries (in place) and on the keys before the store
):
    token = tl.program_id(0).to(tl.int64)
    if ROTATE:
        offs_half = tl.arange(0, BLOCK_HALF)
        half_mask = offs_half < HEAD_DIM // 2
        cos, sin = load_half_angles(cos_ptr, sin_ptr, token, stride_angle, offs_half, HEAD_DIM // 2)
        # A padding row's queries too: the step reads its outputs from the real rows only.
        query = query_ptr + token * stride_query_token
        for first_head in range(0, num_heads, BLOCK_QH):
            offs_qh = first_head + tl.arange(0, BLOCK_QH)
            q_mask = (offs_qh < num_heads)[:, None] & half_mask[None, :]
            rotate_in_place(
                query, stride_query_head, cos, sin, offs_qh, offs_half, q_mask, HEAD_DIM // 2
            )

    slot_id = tl.load(slot_mapping_ptr + token)  # int64, so the page offsets below are too
    if slot_id >= 0:  # else a padding row (a CUDA graph's batch is larger than the step's)
        page = slot_id // page_size
        slot = slot_id % page_size
        kv_offset = page * stride_kv_page + slot * stride_kv_slot
        scale_offset = page * stride_scale_page + slot * stride_scale_slot
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < num_kv_heads
        mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        key_row = key_ptr + token * stride_key_token
        if ROTATE:
            _store_one_rotated(
                key_row, k_cache_ptr + kv_offset, k_scale_ptr + scale_offset, stride_key_head,
                stride_kv_head, stride_scale_head, cos, sin, offs_h, offs_half, h_mask,
                h_mask[:, None] & half_mask[None, :], HEAD_DIM // 2, KV_QUANT,
            )  # fmt: skip
        else:
            _store_one(
                key_row, k_cache_ptr + kv_offset, k_scale_ptr + scale_offset, stride_key_head,
                stride_kv_head, stride_scale_head, offs_h, offs_d, h_mask, mask, KV_QUANT,
            )  # fmt: skip
        _store_one(
            value_ptr + token * stride_value_token, v_cache_ptr + kv_offset,
            v_scale_ptr + scale_offset, stride_value_head, stride_kv_head, stride_scale_head,
            offs_h, offs_d, h_mask, mask, KV_QUANT,
        )  # fmt: skip


def _check_heads(name: str, heads: torch.Tensor, shape: tuple[int, ...], dtypes, device) -> None:
    if tuple(heads.shape) != shape or heads.dtype not in dtypes:
        names = "/".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name} must be {names} {shape}, got {heads.dtype} {tuple(heads.shape)}")
    if heads.stride(-1) != 1 or heads.device != device:
        raise ValueError(f"{name} needs a unit stride along its last dim and the cache's device")


def _launch_store(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KVCacheView,
    slot_mapping: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # query, cos, sin
) -> None:
    args = check_cache(cache, key.device)
    shape = (slot_mapping.shape[0], args.num_kv_heads, args.head_dim)
    for name, tensor in (("key", key), ("value", value)):
        _check_heads(name, tensor, shape, ACTIVATION_DTYPES, key.device)
        if not args.is_quantized and tensor.dtype != args.key.dtype:
            raise ValueError(f"{name} is {tensor.dtype} but the cache is {args.key.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-d int64, got {slot_mapping.dtype}")
    if slot_mapping.device != key.device or slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous and on the cache's device")
    num_tokens = slot_mapping.shape[0]
    if rotation is None:
        # Unread in the kernel: any tensor will do for the pointers, 0 for the sizes.
        query, cos, sin = key, key, key
        num_heads, query_strides, stride_angle = 0, (0, 0), 0
    else:
        query, cos, sin = rotation
        _check_rotation(query, cos, sin, key, num_tokens, args.head_dim)
        num_heads, query_strides, stride_angle = query.shape[1], query.stride()[:2], cos.stride(0)
    if num_tokens == 0:
        return

    # The kernel writes e4m3 as bytes (see _e4m3_bits).
    is_fp8 = args.kv_quant == "fp8"
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        args.key.view(torch.uint8) if is_fp8 else args.key,
        args.value.view(torch.uint8) if is_fp8 else args.value,
        *args.scale_pointers(),
        slot_mapping,
        query,
        cos,
        sin,
        args.page_size,
        args.num_kv_heads,
        num_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *query_strides,
        stride_angle,
        *args.kv_strides,
        *args.scale_strides,
        HEAD_DIM=args.head_dim,
        BLOCK_H=next_power_of_2(args.num_kv_heads),
        BLOCK_QH=min(next_power_of_2(max(num_heads, 1)), _MAX_QUERY_HEADS_AT_A_TIME),
        BLOCK_D=next_power_of_2(args.head_dim),
        BLOCK_HALF=next_power_of_2(max(args.head_dim // 2, 1)),
        KV_QUANT=args.kv_quant,
        ROTATE=rotation is not None,
        num_warps=4,
        enable_fp_fusion=False,  # RoPE rounds as its twin does (cuda_ops.rotated_halves)
    )


# Query heads a program rotates at a time, so that a model with many heads does not hold all of
# them in registers at once (8 heads of 128: 1024 float32 values, 8 a thread of 4 warps).
_MAX_QUERY_HEADS_AT_A_TIME = 8
# RoPE's products are rounded to 16 bits before their sum, as the torch twin rounds in those
# dtypes; in float32 a compiler may contract them into an FMA, which the twin never does.
_ROTATION_DTYPES = (torch.float16, torch.bfloat16)


def _check_rotation(query, cos, sin, key, num_tokens: int, head_dim: int) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [N, num_heads, head_dim], got {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of a head's halves; head_dim {head_dim} is odd")
    shape = (num_tokens, query.shape[1], head_dim)
    _check_heads("query", query, shape, _ROTATION_DTYPES, key.device)
    if key.dtype != query.dtype:
        raise ValueError(f"key is {key.dtype} but query is {query.dtype}: RoPE rounds to one")
    for name, angles in (("cos", cos), ("sin", sin)):
        _check_heads(name, angles, (num_tokens, head_dim), ACTIVATION_DTYPES, key.device)
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin need one row stride, got {cos.stride(0)}, {sin.stride(0)}")


def store_kv(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,  # [N, num_kv_heads, head_dim]
    cache: KVCacheView,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """Write token ``n``'s key and value into slot ``slot_mapping[n]`` of ``cache``; a negative
    slot writes nothing (the padding rows of ``common.engine.cuda_graphs``)."""
    _launch_store(key, value, cache, slot_mapping, rotation=None)


def rotate_and_store_kv(
    query: torch.Tensor,  # [N, num_heads, head_dim] fp16/bf16: rotated in place
    key: torch.Tensor,  # [N, num_kv_heads, head_dim], query's dtype
    value: torch.Tensor,  # [N, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [N, head_dim] (its two halves equal)
    sin: torch.Tensor,  # [N, head_dim]
    cache: KVCacheView,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """RoPE on ``query`` in place and on ``key``, then ``store_kv`` of the rotated key and
    ``value``, in one launch. ``key`` itself is left as it was: the layer reads its keys from
    the pages. The rotation has the bits of ``apply_rope`` in the 16-bit dtypes it takes."""
    _launch_store(key, value, cache, slot_mapping, rotation=(query, cos, sin))
