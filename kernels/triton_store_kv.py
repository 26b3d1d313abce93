"""KV store: write a step's new keys and values into their pages, quantising to FP8 or int8.

Twin: ``kernels.reference.store_kv_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interface import FP8_MAX, FP8_MIN_SCALE, INT8_MAX, INT8_SCALE_BITS_BASE, KVCacheView
from kernels.sizes import next_power_of_2
from kernels.triton_paged import ACTIVATION_DTYPES, check_cache, int8_scale

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
def _store_one(
    src_ptr,  # [N, num_kv_heads, head_dim], at this token
    cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] at this slot; uint8 if FP8
    scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 or uint8 code, at this slot
    stride_src_head,
    stride_kv_head,
    stride_scale_head,
    offs_h,  # [BLOCK_H]
    offs_d,  # [BLOCK_D]
    h_mask,  # [BLOCK_H]
    d_mask,  # [BLOCK_D]
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    mask = h_mask[:, None] & d_mask[None, :]
    x = tl.load(src_ptr + offs_h[:, None] * stride_src_head + offs_d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + offs_h[:, None] * stride_kv_head + offs_d[None, :]
    # div_rn in both quantised paths: a plain fp32 division may be approximate on GPU, and the
    # pages and scales must match the reference bit for bit.
    if KV_QUANT == "fp8":
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP8_MIN_SCALE)
        x = tl.clamp(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX, _FP8_MAX)
        tl.store(scale_ptr + offs_h * stride_scale_head, scale, mask=h_mask)
        tl.store(dst, _e4m3_bits(x), mask=mask)
    elif KV_QUANT == "int8":
        x = x.to(tl.float32)
        code = _int8_scale_code(tl.max(tl.abs(x), 1))
        # Half up, floor(y + 0.5) in float32, exactly as the reference rounds.
        y = tl.floor(tl.math.div_rn(x, int8_scale(code)[:, None]) + 0.5)
        tl.store(scale_ptr + offs_h * stride_scale_head, code.to(tl.uint8), mask=h_mask)
        tl.store(dst, tl.clamp(y, -_INT8_MAX, _INT8_MAX).to(tl.int8), mask=mask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [N, num_kv_heads, head_dim]
    value_ptr,  # [N, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided; uint8 if FP8
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], strided; uint8 if FP8
    k_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    v_scale_ptr,  # [num_pages, page_size, num_kv_heads] float32 (FP8) / uint8 (int8), strided
    slot_mapping_ptr,  # [N] int64
    page_size,
    num_kv_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_head,
    stride_scale_page,
    stride_scale_slot,
    stride_scale_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr,  # "none", "fp8" or "int8"
):
    token = tl.program_id(0)
    slot_id = tl.load(slot_mapping_ptr + token)  # int64, so the page offsets below are too
    if slot_id < 0:  # a padding row (a CUDA graph's batch is larger than the step's)
        return
    page = slot_id // page_size
    slot = slot_id % page_size
    kv_offset = page * stride_kv_page + slot * stride_kv_slot
    scale_offset = page * stride_scale_page + slot * stride_scale_slot

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_kv_heads
    d_mask = offs_d < HEAD_DIM
    _store_one(
        key_ptr + token.to(tl.int64) * stride_key_token,
        k_cache_ptr + kv_offset,
        k_scale_ptr + scale_offset,
        stride_key_head,
        stride_kv_head,
        stride_scale_head,
        offs_h,
        offs_d,
        h_mask,
        d_mask,
        KV_QUANT,
    )
    _store_one(
        value_ptr + token.to(tl.int64) * stride_value_token,
        v_cache_ptr + kv_offset,
        v_scale_ptr + scale_offset,
        stride_value_head,
        stride_kv_head,
        stride_scale_head,
        offs_h,
        offs_d,
        h_mask,
        d_mask,
        KV_QUANT,
    )


def store_kv(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,  # [N, num_kv_heads, head_dim]
    cache: KVCacheView,
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """Write token ``n``'s key and value into slot ``slot_mapping[n]`` of ``cache``; a negative
    slot writes nothing (the padding rows of ``common.engine.cuda_graphs``)."""
    args = check_cache(cache, key.device)
    shape = (slot_mapping.shape[0], args.num_kv_heads, args.head_dim)
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != shape or tensor.dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"{name} must be fp16/bf16/fp32 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if tensor.stride(-1) != 1 or tensor.device != key.device:
            raise ValueError(f"{name} needs a unit head_dim stride and the cache's device")
        if not args.is_quantized and tensor.dtype != args.key.dtype:
            raise ValueError(f"{name} is {tensor.dtype} but the cache is {args.key.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-d int64, got {slot_mapping.dtype}")
    if slot_mapping.device != key.device or slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous and on the cache's device")
    num_tokens = slot_mapping.shape[0]
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
        args.page_size,
        args.num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *args.kv_strides,
        *args.scale_strides,
        HEAD_DIM=args.head_dim,
        BLOCK_H=next_power_of_2(args.num_kv_heads),
        BLOCK_D=next_power_of_2(args.head_dim),
        KV_QUANT=args.kv_quant,
        num_warps=4,
    )
