"""SiLU-and-multiply and RoPE as one Triton kernel each, for models on CUDA (RMSNorm's one kernel
is ``kernels/triton/invariant.py``'s, which rounds where the torch module does).

Written as torch ops, a Llama layer's RMSNorm is 8 kernels (cast, square, mean, add, rsqrt,
multiply, cast, multiply), RoPE 5 per tensor and SiLU-and-multiply 2: on a GPU a small model's
decode step is mostly these launches, each reading and writing the whole activation. Here each
is one pass over its rows. ``kernels/layer_kernels.py``'s ``CudaKernels`` swaps them, and the
one-kernel RMSNorm, in on CUDA (not in deterministic mode, which has its own kernels, nor with
``--enforce-eager``).

Every kernel rounds where its torch twin (``common/model/llama.py``) rounds: RoPE's two products
are each rounded to the model's dtype before their sum, SiLU is rounded before the multiply. So
RoPE gives the twin's bits (launched without FP fusion, see ``rotated_halves``); SiLU-and-multiply
differs where its exp's last bit tips a rounding. On the Triton attention backend RoPE runs
inside the KV store's launch (``kernels/triton/store_kv.py``'s ``rotate_and_store_kv``), with
the jit helpers here; this module's own RoPE kernel serves where the store does not rotate
(int8 pages, whose heads are turned between RoPE and the store; the other backends).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from kernels.sizes import ceil_div, next_power_of_2

# 16-bit only: every kernel rounds between its products and sums, as its twin does, so no FMA
# contraction can change a bit; in float32 a compiler would contract them, and float32 is the
# dtype the engine is checked against transformers in.
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [rows, 2 * size], unit stride along it
    out_ptr,  # [rows, size], contiguous
    size,
    stride_gate_up,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    base = gate_up_ptr + row * stride_gate_up
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_half_angles(
    cos_ptr,  # [tokens, head_dim] (its two halves equal)
    sin_ptr,
    token,  # int64
    stride_angle,
    offs_half,  # [BLOCK_HALF]
    HALF: tl.constexpr,
):
    """A token's cos and sin over the first half of a head, as [1, BLOCK_HALF] float32."""
    mask = offs_half < HALF
    cos = tl.load(cos_ptr + token * stride_angle + offs_half, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_angle + offs_half, mask=mask, other=0.0)
    return cos.to(tl.float32)[None, :], sin.to(tl.float32)[None, :]


@triton.jit
def rotated_halves(
    src_ptr,  # [heads, head_dim] at one token, unit stride within a head
    stride_head,
    cos,  # [1, BLOCK_HALF] float32, from load_half_angles
    sin,  # [1, BLOCK_HALF] float32
    offs_h,  # [BLOCK_H]
    offs_half,  # [BLOCK_HALF]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
):
    """RoPE of the head vectors at ``src_ptr``, as their two halves in their dtype.

    The twin: ``x * cos + cat(-x2, x1) * sin``, each product rounded to the dtype, then the sum.
    A kernel that calls this must be launched with ``enable_fp_fusion=False``: on an H100 the
    compiler otherwise made each product and sum one bf16 FMA (the product unrounded), and a
    quarter of the outputs were a bit off the twin's. Each output element is made from the two
    elements at its own place in the halves, so a caller may store it in place: no element is
    read by one thread and written by another (the threads of a program are not ordered between
    a load and a store)."""
    first = src_ptr + offs_h[:, None] * stride_head + offs_half[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def rotate_in_place(
    src_ptr,  # [heads, head_dim] at one token, unit stride within a head
    stride_head,
    cos,  # [1, BLOCK_HALF] float32, from load_half_angles
    sin,  # [1, BLOCK_HALF] float32
    offs_h,  # [BLOCK_H]
    offs_half,  # [BLOCK_HALF]
    mask,  # [BLOCK_H, BLOCK_HALF]
    HALF: tl.constexpr,
):
    out1, out2 = rotated_halves(src_ptr, stride_head, cos, sin, offs_h, offs_half, mask, HALF)
    first = src_ptr + offs_h[:, None] * stride_head + offs_half[None, :]
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,  # [tokens, heads, head_dim], unit stride within a head; rotated in place
    cos_ptr,  # [tokens, head_dim] (its two halves equal)
    sin_ptr,
    heads,
    stride_token,
    stride_head,
    stride_angle,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_HEADS)
    col = tl.arange(0, BLOCK_HALF)
    mask = (head < heads)[:, None] & (col < HALF)[None, :]
    cos, sin = load_half_angles(cos_ptr, sin_ptr, token, stride_angle, col, HALF)
    rotate_in_place(x_ptr + token * stride_token, stride_head, cos, sin, head, col, mask, HALF)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [rows, 2 * size]`` (gate first)."""
    size = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(size))
    if gate_up.shape[0]:
        grid = (gate_up.shape[0], ceil_div(size, block))
        _silu_and_mul_kernel[grid](gate_up, out, size, gate_up.stride(0), BLOCK=block)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` in place by ``cos``/``sin [tokens, head_dim]``."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if tokens:
        _rope_kernel[(tokens,)](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0),
            HALF=half,
            BLOCK_HEADS=next_power_of_2(heads),
            BLOCK_HALF=next_power_of_2(half),
            enable_fp_fusion=False,  # see rotated_halves
        )  # fmt: skip
    return x


class CudaSiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous())


class CudaRotaryApply(nn.Module):
    """Rotates q and k in place (they may be strided views of one qkv buffer)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_(q, cos, sin), rope_(k, cos, sin)


def cuda_ops_apply(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these modules can stand in for a model of ``dtype`` and ``head_dim``."""
    return dtype in _DTYPES and head_dim % 2 == 0
