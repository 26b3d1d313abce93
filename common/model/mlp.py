"""The gated MLP of every supported family (a dense layer's, and each expert's of a mixture),
and how a module takes its kernels' twin of a part (``use_kernels``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.model.parallel import TensorParallel
from kernels.layer_kernels import LayerKernels
from kernels.lora import LoraSegments
from kernels.quantized import QuantizedLinear

if TYPE_CHECKING:
    from common.model.lora_layers import LoraProjection


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of a fused gate_up projection."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` over this rank's slice ``width`` of the MLP's width:
    gate/up split by columns, down by rows, so the output is a partial sum that ``tp``'s
    all-reduce completes. An expert passes the unsharded group: the mixture reduces once for
    all of its experts (``common/model/moe.py``)."""

    def __init__(self, hidden_size: int, width: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = width
        # nn.Linear until use_kernels swaps in the device's twins.
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down_proj: nn.Module = nn.Linear(width, hidden_size, bias=False)
        self.act: nn.Module = SiluAndMul()
        # Adapter slots (common/model/lora.py's attach_lora); None: no LoRA served.
        self.gate_up_lora: LoraProjection | None = None
        self.down_lora: LoraProjection | None = None

    def forward(self, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        """``lora``: the rows computing under an adapter, each projection's delta added to
        its output (a row-parallel one's before the all-reduce: a partial sum like its own)."""
        if lora is None or self.gate_up_lora is None or self.down_lora is None:
            return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))
        gate_up = self.gate_up_proj(x)
        self.gate_up_lora.add(gate_up, x, lora)
        activated = self.act(gate_up)
        down = self.down_proj(activated)
        self.down_lora.add(down, activated, lora)
        return self.tp.all_reduce(down)

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Take ``kernels``' twins of the projections and SiLU-and-multiply."""
        self.gate_up_proj = swapped_linear(kernels, self.gate_up_proj)
        self.down_proj = swapped_linear(kernels, self.down_proj)
        self.act = kept_if_none(kernels.activation(), self.act)


def swapped_linear(kernels: LayerKernels, linear: nn.Module) -> nn.Module:
    """``kernels``' twin of ``linear`` (an ``nn.Linear`` or a ``QuantizedLinear``), or
    ``linear`` where it has none."""
    if isinstance(linear, QuantizedLinear):
        return kept_if_none(kernels.quantized_linear(linear), linear)
    weight, bias = cast(torch.Tensor, linear.weight), cast("torch.Tensor | None", linear.bias)
    return kept_if_none(kernels.linear(weight, bias), linear)


def swapped_norm(
    make: Callable[[torch.Tensor, float], nn.Module | None], norm: nn.Module
) -> nn.Module:
    """``make``'s twin of ``norm`` (an RMSNorm, its weight shared), or ``norm`` where none."""
    return kept_if_none(make(cast(torch.Tensor, norm.weight), cast(float, norm.eps)), norm)


def kept_if_none(twin: nn.Module | None, module: nn.Module) -> nn.Module:
    return module if twin is None else twin
