"""Batched LoRA on CUDA: Punica's SGMV as a shrink and an expand kernel over segments of rows
by adapter (``kernels/lora.py`` has the layout and the torch twin, ``lora_delta_reference``).

- ``_shrink_kernel``: one program per (segment, block of its rows); ``x[rows] @ a[slot].T``
  summed over ``in`` in ``BLOCK_K`` steps, in float32, into ``shrunk [N, R]`` (float32).
- ``_expand_kernel``: one program per (segment, block of its rows, block of output columns);
  ``shrunk[rows] @ b[slot]`` over the whole of ``R`` at once (a rank is small), times the
  slot's scale, added to ``out[rows]`` and rounded to its dtype once.

Rows of no segment are never read nor written. The grid is sized by the longest segment; a
program past its own segment's end returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora import LoraSegments
from kernels.sizes import ceil_div, next_power_of_2

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# tl.dot's least tile side.
_MIN_TILE = 16


@triton.jit
def _shrink_kernel(
    x_ptr,  # [N, K], unit stride along K
    a_ptr,  # [slots, R, K], contiguous
    shrunk_ptr,  # [N, R] float32, contiguous
    start_ptr,  # [G] int32
    end_ptr,  # [G] int32
    slot_ptr,  # [G] int32
    K,
    R,
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(start_ptr + segment)
    end = tl.load(end_ptr + segment)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slot_ptr + segment).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot * R * K
    for k in range(0, K, BLOCK_K):
        k_mask = (k + cols) < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + (k + cols)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + ranks[None, :] * K + (k + cols)[:, None],
            mask=rank_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A's rows as columns
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(
        shrunk_ptr + rows[:, None].to(tl.int64) * R + ranks[None, :],
        acc,
        mask=row_mask[:, None] & rank_mask[None, :],
    )


@triton.jit
def _expand_kernel(
    shrunk_ptr,  # [N, R] float32, contiguous
    b_ptr,  # [slots, R, M_out], contiguous
    scale_ptr,  # [slots] float32
    out_ptr,  # [N, M_out], unit stride along M_out
    start_ptr,  # [G] int32
    end_ptr,  # [G] int32
    slot_ptr,  # [G] int32
    M_out,
    R,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(start_ptr + segment)
    end = tl.load(end_ptr + segment)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slot_ptr + segment).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < M_out
    shrunk = tl.load(
        shrunk_ptr + rows[:, None].to(tl.int64) * R + ranks[None, :],
        mask=row_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * R * M_out + ranks[:, None].to(tl.int64) * M_out + cols[None, :],
        mask=rank_mask[:, None] & col_mask[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    delta = tl.dot(shrunk, b.to(tl.float32)) * tl.load(scale_ptr + slot)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    out = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_delta(
    out: torch.Tensor,  # [N, out_features], updated in place
    x: torch.Tensor,  # [N, in_features]
    a: torch.Tensor,  # [slots, R, in_features]
    b: torch.Tensor,  # [slots, R, out_features]
    scales: torch.Tensor,  # [slots] float32
    segments: LoraSegments,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> None:
    """Add each segment's LoRA delta to its rows of ``out`` (``lora_delta_reference``'s
    contract), as one shrink launch and one expand launch."""
    if x.dtype not in _DTYPES or a.dtype != x.dtype or b.dtype != x.dtype:
        raise ValueError(f"lora_delta takes x, a and b in one of {_DTYPES}: {x.dtype}, {a.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"lora_delta's scales are float32, not {scales.dtype}")
    slots, rank, in_features = a.shape
    if b.shape[0] != slots or b.shape[1] != rank or scales.shape != (slots,):
        raise ValueError(f"lora_delta: a {tuple(a.shape)}, b {tuple(b.shape)} do not agree")
    if x.shape[1] != in_features or out.shape[1] != b.shape[2] or x.shape[0] != out.shape[0]:
        raise ValueError(
            f"lora_delta: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a "
            f"{tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("lora_delta needs x and out with unit stride along their rows")
    a, b = a.contiguous(), b.contiguous()
    num_segments = segments.launch_segments
    row_blocks = ceil_div(segments.launch_rows, block_m)
    block_r = max(_MIN_TILE, next_power_of_2(rank))
    shrunk = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_segments, row_blocks)](
        x,
        a,
        shrunk,
        segments.start_rows,
        segments.end_rows,
        segments.slot_ids,
        in_features,
        rank,
        x.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    out_features = out.shape[1]
    _expand_kernel[(num_segments, row_blocks, ceil_div(out_features, block_n))](
        shrunk,
        b,
        scales,
        out,
        segments.start_rows,
        segments.end_rows,
        segments.slot_ids,
        out_features,
        rank,
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
