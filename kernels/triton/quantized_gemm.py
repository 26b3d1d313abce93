"""Quantized weights on CUDA: ``y = x W^T (+ b)`` with ``W`` read as its codes and scales
(``kernels/quantized.py``), decoded in registers, never written out in 16 bits.

One kernel for the three kinds of code: int8, 4-bit (two to a byte, the low nibble the even
input) and FP8 e4m3 (its bits moved into a float32's: exact, and the same on every GPU and in
the interpreter). Each program owns an output tile and walks K from 0 in ``BLOCK_K`` steps: it
loads ``x``'s tile, decodes the weight tile, applies each element's group scale and offset,
and multiplies on the tensor cores in ``x``'s dtype (float32 sums); float32 inputs multiply in
float32 ("ieee"). Decode steps take 16-row tiles, prefill chunks 64-row ones.

Twin: ``QuantizedLinear`` (the weight dequantized, then ``F.linear``): equal up to summation
order, and up to the weight's rounding to a 16-bit ``x``'s dtype, which the dense twin of a
16-bit model rounds alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from kernels.quantized import FP8_E4M3, INT8, UINT4, QuantizedLinear
from kernels.sizes import ceil_div

BLOCK_N, BLOCK_K = 64, 64
SMALL_M, LARGE_M = 16, 64  # rows of a tile: decode steps, prefill chunks
CODE_KINDS = {INT8: 0, UINT4: 1, FP8_E4M3: 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _decoded(codes_ptr, cols, offs_k, mask, stride_codes, KIND: tl.constexpr):
    """The code values of weight tile ``[BLOCK_K, BLOCK_N]`` (k down, columns across), float32."""
    rows = cols.to(tl.int64)[None, :] * stride_codes
    if KIND == 0:
        return tl.load(codes_ptr + rows + offs_k[:, None], mask=mask, other=0).to(tl.float32)
    if KIND == 1:
        byte = tl.load(codes_ptr + rows + (offs_k // 2)[:, None], mask=mask, other=0).to(tl.int32)
        return ((byte >> ((offs_k % 2) * 4)[:, None]) & 0xF).to(tl.float32)
    bits = tl.load(codes_ptr + rows + offs_k[:, None], mask=mask, other=0).to(tl.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    # e4m3fn's normal values 2^(e - 7) (1 + m / 8) are float32's with exponent e - 7 + 127
    # and the mantissa's three bits on top; its subnormals (e = 0) are m 2^-9.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit(do_not_specialize=["num_rows"])
def _quantized_linear_kernel(
    x_ptr,  # [num_rows, K], unit stride along K
    codes_ptr,  # [N, K] int8 / uint8, or [N, ceil(K / 2)] uint8 for 4-bit
    scales_ptr,  # [N, groups] float32
    offsets_ptr,  # [N, groups] float32 (the scales when HAS_OFFSETS is off: never read)
    bias_ptr,  # [N] (the scales when HAS_BIAS is off: never read)
    out_ptr,  # [num_rows, N], contiguous
    num_rows,
    N,
    K,
    stride_x_row,
    stride_codes,
    num_groups,
    group_size,
    KIND: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row
    group_rows = cols.to(tl.int64)[None, :] * num_groups
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & col_mask[None, :]
        groups = group_rows + (offs_k // group_size)[:, None]
        w = _decoded(codes_ptr, cols, offs_k, mask, stride_codes, KIND)
        w = w * tl.load(scales_ptr + groups, mask=mask, other=0.0)
        if HAS_OFFSETS:
            w = w - tl.load(offsets_ptr + groups, mask=mask, other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def quantized_linear(
    x: torch.Tensor, layer: QuantizedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` with ``W`` = ``layer.qweight``, in ``x``'s dtype."""
    weight = layer.qweight
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantized_linear takes fp16/bf16/fp32 inputs, got {x.dtype}")
    if x.shape[-1] != weight.in_features or x.device != weight.device:
        raise ValueError(f"x {tuple(x.shape)} on {x.device} does not match the weight")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, k = rows.shape
    n = weight.out_features
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*x.shape[:-1], n)
    block_m = SMALL_M if num_rows <= SMALL_M else LARGE_M
    grid = (ceil_div(num_rows, block_m), ceil_div(n, BLOCK_N))
    _quantized_linear_kernel[grid](
        rows,
        weight.codes,
        weight.scales,
        weight.scales if weight.offsets is None else weight.offsets,
        weight.scales if bias is None else bias,
        out,
        num_rows,
        n,
        k,
        rows.stride(0),
        weight.codes.stride(0),
        weight.scales.shape[1],
        weight.group_size,
        KIND=CODE_KINDS[weight.kind],
        HAS_OFFSETS=weight.offsets is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=3,
    )
    return out.view(*x.shape[:-1], n)


class TritonQuantizedLinear(nn.Module):
    """Stands in for a ``QuantizedLinear`` on CUDA: the same codes, read by the kernel above."""

    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        self.layer = layer
        self.activations = layer.activations
        self.bias = None if layer.bias is None else layer.bias.detach().contiguous()
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            x = self.activations.apply(x)
        return quantized_linear(x, self.layer, self.bias)
