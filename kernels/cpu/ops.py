"""Drop-in CPU modules for a bf16 decoder layer's elementwise parts, backed by
``kernels/cpu/decoder_ops.c``: one pass and one call each instead of a chain of torch ops.

Each replaces the torch module of the same role in ``common/model/llama.py`` (``RMSNorm``,
``SiluAndMul``, ``RotaryApply``) and computes the same thing with the same bf16 roundings.
``argmax_rows_c`` is the sampler's ``argmax(dim=-1)`` (``kernels/cpu/row_argmax.c``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import library as cpu_library

# rotate_half works on halves of a head vector; the kernel keeps a half on its stack.
MAX_HEAD_DIM = 512


class CpuRMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight.detach().contiguous()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] bf16
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=torch.bfloat16)
        cpu_library.load().pdserve_rms_norm_bf16(
            rows.data_ptr(),
            rows.stride(0),
            self.weight.data_ptr(),
            self.eps,
            out.data_ptr(),
            out.stride(0),
            rows.shape[0],
            rows.shape[1],
        )
        return out.view(x.shape)

    def add_and_norm(
        self,
        x: torch.Tensor,  # [N, hidden] bf16
        delta: torch.Tensor,  # [N, hidden] bf16
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta, and its norm
        """``(x + delta, self(x + delta))`` in one pass, the same bits as the two calls."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if delta.stride(-1) != 1:
            delta = delta.contiguous()
        total = torch.empty(x.shape, dtype=torch.bfloat16)
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        cpu_library.load().pdserve_add_rms_norm_bf16(
            x.data_ptr(),
            x.stride(0),
            delta.data_ptr(),
            delta.stride(0),
            self.weight.data_ptr(),
            self.eps,
            total.data_ptr(),
            total.stride(0),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            x.shape[1],
        )
        return total, out


class CpuSiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2 * width] bf16
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        width = gate_up.shape[-1] // 2
        out = torch.empty((gate_up.shape[0], width), dtype=torch.bfloat16)
        cpu_library.load().pdserve_silu_mul_bf16(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            out.shape[0],
            width,
        )
        return out


class CpuRotaryApply(nn.Module):
    """Rotates q and k in place (they may be strided views of one qkv buffer)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        library = cpu_library.load()
        for x in (q, k):  # [N, heads, head_dim] bf16, unit stride within a head
            library.pdserve_rope_bf16(
                x.data_ptr(),
                x.stride(0),
                x.stride(1),
                x.shape[0],
                x.shape[1],
                x.shape[2],
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(0),
            )
        return q, k


def cpu_ops_apply(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these modules can stand in for a model of ``dtype`` and ``head_dim``."""
    return (
        dtype == torch.bfloat16
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 2 == 0
        and cpu_library.available()
    )


def argmax_rows_c(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of a 2-D float32 tensor on the CPU through the C kernel (the same
    indices: the first of equal maxima, NaN above every number), or None where the kernel does
    not take ``x``."""
    if (
        x.dim() != 2
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.shape[1] == 0
        or x.stride(-1) != 1
        or not cpu_library.available()
    ):
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    cpu_library.load().pdserve_argmax_f32(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr()
    )
    return out
