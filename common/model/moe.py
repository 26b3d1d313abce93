"""A mixture of experts in place of a layer's MLP: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Each token's hidden state goes through a router (a linear layer to one logit per expert), runs
the ``top_k`` experts with the largest softmax probabilities, and sums their outputs weighted
by those probabilities (renormalised to sum to one where the family says,
``common/moe_config.py``). Qwen2-MoE adds a shared expert that every token runs, scaled by a
sigmoid gate of its own.

The sum is in float32 and rounded to the model's dtype once: in float32 models that is
``transformers``' own arithmetic (a zero tensor, each expert's weighted output added in
ascending expert order); in bf16 it rounds once where ``transformers`` rounds each term, so an
expert repeated N times gives the repeated MLP's bits exactly (the upcycling oracle). A token's
sum runs in ascending expert order whatever else is in the batch, so with batch-invariant GEMMs
the layer is batch-invariant too.

Without a fused kernel (``LayerKernels.experts``) the experts run one after another over the
tokens that chose them, gathered once: a decode step reads only the experts its tokens chose,
and each expert's projections are the device's linear kernels, quantized ones included.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from common.model.mlp import MLP, swapped_linear
from common.model.parallel import TensorParallel
from common.moe_config import MoEConfig
from kernels.layer_kernels import LayerKernels

# The experts' own projections are never reduced over ranks one by one: the mixture's output
# is, once (common/model/parallel.py).
_UNREDUCED = TensorParallel()


def route(
    logits: torch.Tensor,  # [N, num_experts], the router's output
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, top_k] float32, experts [N, top_k] int64
    """The experts each token runs, and the weight of each: softmax in float32, the ``top_k``
    largest probabilities (ties to the lower expert id, as ``torch.topk``), renormalised to
    sum to one where ``renormalize``."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """The experts this rank holds (``tp.experts``, each its ``tp.expert_part`` of the width),
    the router (whole on every rank) and, for Qwen2-MoE, the shared expert (split as a dense
    MLP). One all-reduce completes the output, as a dense MLP's."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.moe = moe
        self.hidden_size = hidden_size
        held = tp.experts(moe.num_experts)
        self.first_expert = held.start
        self.num_local_experts = len(held)
        width = len(tp.expert_part(moe.expert_intermediate_size))
        # The router, named as the checkpoints name it.
        self.gate: nn.Module = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden_size, width, _UNREDUCED) for _ in range(self.num_local_experts)
        )
        # A twin that runs all experts at once (LayerKernels.experts); None: one by one.
        self.fused_experts: nn.Module | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Module | None = None
        if moe.shared_expert_intermediate_size:
            shared_width = len(tp.part(moe.shared_expert_intermediate_size))
            self.shared_expert = MLP(hidden_size, shared_width, _UNREDUCED)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        weights, chosen = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        if self.fused_experts is not None:
            total = self.fused_experts(x, chosen, weights).float()
        else:
            total = self.run_experts(x, chosen, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(self.shared_expert_gate(x))
            total += (scale * self.shared_expert(x)).float()
        return self.tp.all_reduce(total.to(x.dtype))

    def run_experts(
        self,
        x: torch.Tensor,  # [N, hidden]
        chosen: torch.Tensor,  # [N, top_k] expert ids, all experts' numbering
        weights: torch.Tensor,  # [N, top_k] float32
    ) -> torch.Tensor:  # [N, hidden] float32: the weighted sum over this rank's experts
        """Each held expert over the tokens that chose it, in ascending expert order."""
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        # (token, slot) pairs grouped by expert, by token within each: gathered once.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_weights = weights.reshape(-1)
        start = sum(counts[: self.first_expert])
        for local, expert in enumerate(self.experts):
            count = counts[self.first_expert + local]
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // top_k
            out = expert(x.index_select(0, tokens))
            total.index_add_(0, tokens, out.float() * flat_weights[pairs, None])
        return total

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Take ``kernels``' twin of all the experts at once where it has one (their one-by-one
        modules then dropped), else each expert takes its projections' twins; the router and
        the shared expert take theirs."""
        self.gate = swapped_linear(kernels, self.gate)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            self.shared_expert.use_kernels(kernels)
            self.shared_expert_gate = swapped_linear(kernels, self.shared_expert_gate)
        experts = cast("list[MLP]", list(self.experts))
        fused = kernels.experts(experts, self.first_expert, self.moe.num_experts)
        if fused is not None:
            self.fused_experts = fused
            self.experts = nn.ModuleList()
            return
        for expert in experts:
            expert.use_kernels(kernels)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(out, in)`` of one expert's projections and the router's."""
        width = len(self.tp.expert_part(self.moe.expert_intermediate_size))
        hidden = self.hidden_size
        return [(2 * width, hidden), (hidden, width), (self.moe.num_experts, hidden)]
