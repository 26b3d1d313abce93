"""The kernels a model's layers run, one set per device and mode, handed out role by role.

A decoder layer is made of a few roles: linear layers, RMSNorms (the layer's two, and the
per-head q/k norms of models that have them), the rotary embedding and SiLU-and-multiply. Each
device and mode has twins of some of them: packed C GEMMs and single-pass C elementwise ops on
a CPU, one Triton kernel per elementwise op on CUDA, batch-invariant Triton kernels in
deterministic mode. A set answers, for each role, with the module that stands in for the torch
one, or None where the torch module stays; the layer modules (``common/model/llama.py``'s
``use_kernels``) ask for their own parts and hold what they are given. Which set a model runs
is the engine's choice (``LLMEngine._prepare_kernels``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from kernels.cpu.linear import (
    BOTH,
    TILE_DTYPES,
    CpuLinear,
    GemmPlan,
    StepShape,
    choose_gemm_plan,
    probe_plan,
)
from kernels.cpu.ops import CpuRMSNorm, CpuRotaryApply, CpuSiluAndMul, cpu_ops_apply
from kernels.cpu.quantized_linear import CpuQuantizedLinear
from kernels.quantized import QuantizedLinear, RoundedInputs
from kernels.triton.elementwise import CudaRotaryApply, CudaSiluAndMul
from kernels.triton.fused_moe import MOE_TILE_TIERS, MoETiles, TritonFusedMoE
from kernels.triton.invariant import InvariantLinear, InvariantRMSNorm
from kernels.triton.quantized_gemm import TritonQuantizedLinear


class LayerKernels:
    """The torch modules themselves: every role answers None, keep what is there."""

    # What the set's linear layers learn of each step before it runs (the CPU's GEMMs pick
    # their kernel by it); None where they need nothing.
    step_shape: StepShape | None = None

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """``y = x W^T + b`` (the output projection included, ``bias`` None)."""
        return None

    def quantized_linear(self, linear: QuantizedLinear) -> nn.Module | None:
        """``linear``'s twin: the same quantized weight, read by this device's kernels."""
        return None

    def norm(self, weight: torch.Tensor, eps: float) -> nn.Module | None:
        """A norm over the hidden size: the layers' two and the final one."""
        return None

    def head_norm(self, weight: torch.Tensor, eps: float) -> nn.Module | None:
        """A norm over each head vector of the queries or keys (Qwen3's q/k norms)."""
        return None

    def rotary(self) -> nn.Module | None:
        """Rotates queries and keys by their positions' angles (``RotaryApply``'s role)."""
        return None

    def activation(self) -> nn.Module | None:
        """silu(gate) * up over a fused gate_up projection (``SiluAndMul``'s role)."""
        return None

    def experts(
        self, experts: Sequence[nn.Module], first_expert: int, num_experts: int
    ) -> nn.Module | None:
        """One module for all of a mixture's ``experts`` (MLPs, experts ``first_expert`` on of
        ``num_experts``; ``common/model/moe.py``), called as ``(hidden [N, H], chosen [N, k]
        expert ids, weights [N, k] float32)`` and returning the weighted sum over these experts,
        ``[N, H]`` (float32, or rounded to the hidden dtype once). None: the experts run one by
        one, each on its own kernels."""
        return None


class CpuKernels(LayerKernels):
    """Packed C GEMMs and, for bf16 models, the single-pass C norms, rotary and SiLU-and-
    multiply. The q/k norms stay torch's: their rows are single head vectors.

    The GEMMs hold each weight in the forms the fastest kernels of this machine want, timed on
    the model's own weights: packed for every kernel first, then ``settle_plan`` keeps what the
    machine's plan uses. ``deterministic`` takes the tiles, whose sums do not depend on the row
    count, at every row count."""

    def __init__(
        self, dtype: torch.dtype, num_params: int, head_dim: int, deterministic: bool = False
    ) -> None:
        self.plan = probe_plan(dtype, num_params, deterministic)
        self.dtype = dtype
        self.deterministic = deterministic
        self.step_shape = StepShape()
        self.elementwise = cpu_ops_apply(dtype, head_dim)

    def settle_plan(self, modules: Iterable[nn.Module]) -> GemmPlan:
        """Once the layers took their linears (``modules``, all of the model's): the plan this
        machine chose for their shapes (probed on first use), each layer restricted to it and
        its unused forms of the weight dropped. Returns the plan."""
        if self.plan == BOTH:
            linears = [module for module in modules if isinstance(module, CpuLinear)]
            self.plan = choose_gemm_plan(linears)
            for linear in linears:
                linear.restrict(self.plan)
        return self.plan

    def linear(self, weight, bias) -> nn.Module:
        return CpuLinear(weight, bias, self.plan, self.step_shape)

    def quantized_linear(self, linear: QuantizedLinear) -> nn.Module | None:
        """The C kernels over the codes as they are (``kernels/cpu/quantized_tiles.c``); a
        model in neither bf16 nor float32 keeps the torch twin."""
        if self.dtype not in TILE_DTYPES:
            return None
        return CpuQuantizedLinear(
            linear.qweight,
            linear.bias,
            self.dtype,
            self.step_shape,
            linear.activations,
            tiles_only=self.deterministic,
        )

    def norm(self, weight, eps) -> nn.Module | None:
        return CpuRMSNorm(weight, eps) if self.elementwise else None

    def rotary(self) -> nn.Module | None:
        return CpuRotaryApply() if self.elementwise else None

    def activation(self) -> nn.Module | None:
        return CpuSiluAndMul() if self.elementwise else None


class InvariantKernels(LayerKernels):
    """Deterministic inference on the Triton path: linear layers and norms whose sums do not
    depend on the batch (``kernels/triton/invariant.py``)."""

    def linear(self, weight, bias) -> nn.Module:
        return InvariantLinear(weight, bias)

    def quantized_linear(self, linear: QuantizedLinear) -> nn.Module:
        """A batch-invariant GEMM over the dequantized weight: the same tokens whatever the
        batch, at 16-bit memory (a quantized invariant GEMM is not written yet)."""
        weight = linear.qweight.dequantize(linear.compute_dtype)
        dense = InvariantLinear(weight, linear.bias)
        return dense if linear.activations is None else RoundedInputs(linear.activations, dense)

    def norm(self, weight, eps) -> nn.Module:
        return InvariantRMSNorm(weight, eps)

    def head_norm(self, weight, eps) -> nn.Module:
        return InvariantRMSNorm(weight, eps)

    def experts(self, experts, first_expert, num_experts) -> nn.Module | None:
        """The fused Triton experts with one set of tiles at every batch size: a token's sums
        then run in one order whatever the batch (``kernels/triton/fused_moe.py``)."""
        return fused_triton_experts(experts, first_expert, tiles=MOE_TILE_TIERS[0][1])


class CudaQuantizedKernels(LayerKernels):
    """Any model on CUDA: quantized linear layers read their codes in a Triton GEMM
    (``kernels/triton/quantized_gemm.py``), a mixture's 16-bit experts run as one fused Triton
    kernel; every other role keeps torch's module."""

    def quantized_linear(self, linear: QuantizedLinear) -> nn.Module:
        return TritonQuantizedLinear(linear)

    def experts(self, experts, first_expert, num_experts) -> nn.Module | None:
        return fused_triton_experts(experts, first_expert)


def fused_triton_experts(
    experts: Sequence[nn.Module], first_expert: int, tiles: MoETiles | None = None
) -> nn.Module | None:
    """``experts`` (MLPs of ``gate_up_proj`` and ``down_proj``) stacked for the fused Triton
    kernel, or None where any projection is quantized: those keep their own GEMMs, one expert
    after another."""
    projections = [(expert.gate_up_proj, expert.down_proj) for expert in experts]
    if not projections or not all(
        isinstance(linear, nn.Linear) for pair in projections for linear in pair
    ):
        return None
    w13 = torch.stack([gate_up.weight.detach() for gate_up, _ in projections])
    w2 = torch.stack([down.weight.detach() for _, down in projections])
    return TritonFusedMoE(w13, w2, first_expert, tiles)


class CudaKernels(CudaQuantizedKernels):
    """16-bit models on CUDA: RMSNorm, SiLU-and-multiply and RoPE as one Triton kernel each
    (``kernels/triton/elementwise.py``; the norm is the batch-invariant one, which rounds where the
    torch module does). Linear layers stay cuBLAS's, quantized ones take the Triton GEMM."""

    def norm(self, weight, eps) -> nn.Module:
        return InvariantRMSNorm(weight, eps)

    def head_norm(self, weight, eps) -> nn.Module:
        return InvariantRMSNorm(weight, eps)

    def rotary(self) -> nn.Module:
        return CudaRotaryApply()

    def activation(self) -> nn.Module:
        return CudaSiluAndMul()
