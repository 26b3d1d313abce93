"""The adapter slots of one projection of one layer (``LoraProjection``), the part of LoRA a
layer holds; ``common/model/lora.py`` reads adapters and fills the slots."""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu.lora_delta import LoraWeights, lora_delta_bf16, lora_weights, takes_rows
from kernels.lora import (
    DENSE_MAX_COLUMNS,
    LoraSegments,
    lora_delta_dense,
    lora_delta_reference,
)


class LoraProjection(nn.Module):
    """The adapter slots of one projection of one layer, this rank's slice of each.

    ``a [slots, S * max_rank, in]`` stacks the ``S`` targets' A's (each zero-padded to
    ``max_rank`` rows); ``b [slots, S * max_rank, out]`` places each target's B (transposed) on
    its own rank rows and its own output columns, zeros elsewhere; ``scales [slots]`` float32."""

    def __init__(
        self,
        targets: tuple[str, ...],
        in_features: int,
        out_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.targets = targets
        self.max_rank = max_rank
        self.out_sizes = out_sizes
        total_rank = len(targets) * max_rank
        self.a = torch.zeros(max_loras, total_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, total_rank, sum(out_sizes), dtype=dtype, device=device)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        # The C kernel's view of the slots (None where it does not take them): it reads the
        # tensors above in place, so writes to a slot need not rebuild it.
        self.cpu_weights: LoraWeights | None = lora_weights(
            self.a, self.b, self.scales, max_rank, out_sizes
        )

    def write(
        self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float
    ) -> None:
        """Put one adapter's (A, B) per target (None: not targeted) in ``slot``, already
        sliced for this rank."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot] = scale
        row = 0
        for index, (part, out_size) in enumerate(zip(parts, self.out_sizes, strict=True)):
            if part is not None:
                a, b = part
                rank, first = a.shape[0], index * self.max_rank
                self.a[slot, first : first + rank] = a
                self.b[slot, first : first + rank, row : row + out_size] = b.t()
            row += out_size

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot] = 0.0

    def add(self, out: torch.Tensor, x: torch.Tensor, segments: LoraSegments) -> None:
        """Add each segment's delta to ``out`` (the base layer's output for ``x``), in place."""
        if out.device.type == "cuda":
            from kernels.triton.lora import lora_delta

            lora_delta(out, x, self.a, self.b, self.scales, segments)
        elif self.cpu_weights is not None and takes_rows(out, x):
            lora_delta_bf16(out, x, self.cpu_weights, segments)
        elif self.a.shape[0] * self.a.shape[1] <= DENSE_MAX_COLUMNS:
            lora_delta_dense(out, x, self.a, self.b, self.scales, segments)
        else:
            lora_delta_reference(out, x, self.a, self.b, self.scales, segments)
