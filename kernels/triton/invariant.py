"""Batch-invariant linear layers and RMSNorm for deterministic inference on the Triton path.

cuBLAS and torch's reductions choose how to split a sum by the shape of the whole call: a GEMM of
8 rows may split K across thread blocks where one of 512 rows does not, and a row mean over a
small batch spreads each row across several blocks. Each choice is exact to a rounding, so the
same request's logits move in their last bits with the batch around it, and near-ties flip.

These kernels fix every sum by what one row needs, whatever the batch:

- ``linear``: one tile shape for every call, K walked in ``BLOCK_K`` steps from 0 by the one
  program that owns an output tile (no split-K), so an output element's sum has one order
  whatever the row count. ``num_rows`` is not specialised on, so one compiled kernel serves
  every batch.
- ``rms_norm``: each row reduced whole within one program, as many rows to a program as
  the row's size allows (so never a function of the batch); ``add_rms_norm`` adds the residual
  first, in the same pass.

Twins: ``torch.nn.functional.linear`` and ``common.model.llama.RMSNorm`` (equal up to summation
order; the tests check that and the invariance itself).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import nn

from kernels.sizes import ceil_div, next_power_of_2

# One tile shape for every call: a change here changes every deterministic answer. Triton's
# interpreter (the tests on a CPU) pays per program and per op, not per element, so it takes
# wider tiles; invariance holds for any one shape.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M, BLOCK_N, BLOCK_K = (64, 128, 128) if INTERPRETING else (64, 64, 64)
# rms_norm: a program normalises whole rows, as many as fit this many elements.
NORM_BLOCK_ELEMENTS = 4096
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    x_ptr,  # [num_rows, K], unit stride along K
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] (the weight itself when HAS_BIAS is off: never read)
    out_ptr,  # [num_rows, N], contiguous
    num_rows,
    N,
    K,
    stride_x_row,
    stride_weight_row,
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
    weight_cols = weight_ptr + cols.to(tl.int64)[None, :] * stride_weight_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            weight_cols + offs_k[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        # "ieee": float32 operands summed as float32, never TF32 (whose use could vary by GPU).
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over ``x [..., K]``, each output element summed over K in one
    fixed order (float32), then rounded once to ``x``'s dtype."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"linear needs fp16/bf16/fp32 operands of one dtype, got {x.dtype}, {weight.dtype}"
        )
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.device != x.device):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    num_rows, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows > 0:
        grid = (ceil_div(num_rows, BLOCK_M), ceil_div(n, BLOCK_N))
        _linear_kernel[grid](
            rows,
            weight,
            weight if bias is None else bias,
            out,
            num_rows,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=4,
            num_stages=3,
        )
    return out.view(*x.shape[:-1], n)


@triton.jit
def _row_block(num_rows, size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``ROWS`` rows (int64, for the offsets), the ``BLOCK`` columns, and which
    of them exist."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < size)[None, :]
    return rows.to(tl.int64), offs, mask


@triton.jit
def _load_rows(ptr, stride_row, rows, offs, mask):
    """Rows of a [num_rows, size] tensor with unit stride along a row, in float32 (zeros
    outside ``mask``)."""
    x = tl.load(ptr + rows[:, None] * stride_row + offs[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _normalise_rows(x, weight_ptr, out_ptr, offs, size, eps):
    """The RMSNorm of float32 rows ``x [ROWS, BLOCK]`` (zeros past ``size``), in the dtype of
    ``out_ptr``'s elements; both norm kernels' one copy of it, so that they round alike."""
    dtype = out_ptr.dtype.element_ty
    # Every row of the block is reduced alike, so a row's sum does not depend on its neighbours.
    mean_square = tl.sum(x * x, 1) / size
    normed = (x * (1.0 / tl.sqrt(mean_square + eps))[:, None]).to(dtype)
    # As the torch module: the normalised row is rounded to the model's dtype, then scaled.
    weight = tl.load(weight_ptr + offs, mask=offs < size, other=0.0)
    return (normed.to(tl.float32) * weight.to(tl.float32)[None, :]).to(dtype)


@triton.jit(do_not_specialize=["num_rows"])  # as the linear kernel's
def _rms_norm_kernel(
    x_ptr,  # [num_rows, size], unit stride along size
    weight_ptr,  # [size]
    out_ptr,  # [num_rows, size], contiguous
    num_rows,
    size,
    stride_x_row,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, offs, mask = _row_block(num_rows, size, ROWS, BLOCK)
    x = _load_rows(x_ptr, stride_x_row, rows, offs, mask)
    out = _normalise_rows(x, weight_ptr, out_ptr, offs, size, eps)
    tl.store(out_ptr + rows[:, None] * size + offs[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    x_ptr,  # [num_rows, size], unit stride along size
    delta_ptr,  # [num_rows, size], unit stride along size
    weight_ptr,  # [size]
    total_ptr,  # [num_rows, size], contiguous: x + delta
    out_ptr,  # [num_rows, size], contiguous: its norm
    num_rows,
    size,
    stride_x_row,
    stride_delta_row,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, offs, mask = _row_block(num_rows, size, ROWS, BLOCK)
    x = _load_rows(x_ptr, stride_x_row, rows, offs, mask)
    delta = _load_rows(delta_ptr, stride_delta_row, rows, offs, mask)
    # As torch adds two 16-bit tensors: in float32, rounded once to their dtype.
    total = (x + delta).to(total_ptr.dtype.element_ty)
    tl.store(total_ptr + rows[:, None] * size + offs[None, :], total, mask=mask)
    out = _normalise_rows(total.to(tl.float32), weight_ptr, out_ptr, offs, size, eps)
    tl.store(out_ptr + rows[:, None] * size + offs[None, :], out, mask=mask)


def _check_norm_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    size = x.shape[-1]
    if x.dtype not in _DTYPES or weight.shape != (size,):
        raise ValueError(
            f"rms_norm needs fp16/bf16/fp32 rows matching weight {tuple(weight.shape)}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, size] with unit stride along a row."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_launch(num_rows: int, size: int) -> tuple[tuple[int], dict[str, int]]:
    """The grid of a norm kernel over ``num_rows`` rows and its constants: how many rows a
    program takes depends on ``size`` alone (so never on the batch)."""
    block = next_power_of_2(size)
    rows_per_program = max(1, NORM_BLOCK_ELEMENTS // block)
    launch = {"ROWS": rows_per_program, "BLOCK": block, "num_warps": 4 if block <= 4096 else 8}
    return (ceil_div(num_rows, rows_per_program),), launch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of ``x [..., size]`` in float32; how many rows a program takes
    depends on ``size`` alone."""
    _check_norm_operands(x, weight)
    rows = _rows_of(x)
    num_rows, size = rows.shape
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if num_rows > 0:
        grid, launch = _norm_launch(num_rows, size)
        _rms_norm_kernel[grid](rows, weight, out, num_rows, size, rows.stride(0), eps, **launch)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))`` in one kernel, the same bits as the two calls: a
    layer's residual add and the norm after it, which read and wrote the rows twice more."""
    _check_norm_operands(x, weight)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm adds rows of one shape and dtype, got {x.dtype} {tuple(x.shape)} "
            f"and {delta.dtype} {tuple(delta.shape)}"
        )
    rows, deltas = _rows_of(x), _rows_of(delta)
    num_rows, size = rows.shape
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if num_rows > 0:
        grid, launch = _norm_launch(num_rows, size)
        _add_rms_norm_kernel[grid](
            rows,
            deltas,
            weight,
            total,
            out,
            num_rows,
            size,
            rows.stride(0),
            deltas.stride(0),
            eps,
            **launch,
        )
    return total.view(x.shape), out.view(x.shape)


class InvariantLinear(nn.Module):
    """Stands in for an ``nn.Linear`` (same weight and bias), summing through ``linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class InvariantRMSNorm(nn.Module):
    """Stands in for ``common.model.llama.RMSNorm``, normalising through ``rms_norm``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight.detach().contiguous()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta, and its norm
        """``(x + delta, self(x + delta))`` in one kernel (``add_rms_norm``), the same bits
        as the two calls; ``common.model.llama.add_and_norm`` finds it."""
        return add_rms_norm(x, delta, self.weight, self.eps)
