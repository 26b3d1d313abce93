"""Batched LoRA: the rows of one forward grouped by adapter, and the torch twin of the kernels
that add each group's low-rank delta to a projection's output.

A forward's rows are flattened sequence by sequence; sequences under the same adapter that sit
side by side form one **segment**. A projection's adapters live in slots of two stacked
tensors: ``a [slots, R, in]`` and ``b [slots, out, R]``, where ``R`` is the largest rank the
engine serves times the projection's slices (q, k and v share one projection: their A's are
stacked along ``R`` and their B's laid block-diagonally, so one shrink and one expand serve all
three). A smaller rank is zero-padded, which adds nothing. For every segment

    out[rows] += (x[rows] @ a[slot].T) @ b[slot].T * scale[slot]

— Punica's SGMV: a *shrink* to ``R`` columns, an *expand* back to ``out``. Rows of the base
model belong to no segment and are left as they are. ``kernels/triton/lora.py`` is the CUDA
pair; ``lora_delta_reference`` below, per segment with torch matmuls, is its twin and the CPU's
path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LoraSegments:
    """Which adapter slot each run of a forward's rows computes under: built once per step by
    the runner, read by every LoRA projection of every layer. Rows outside every segment are
    the base model's."""

    starts: list[int]  # [G] first row of each segment, ascending
    ends: list[int]  # [G] one past its last row
    slots: list[int]  # [G] its adapter's slot
    # The same three as int32 tensors on the forward's device, for the kernels.
    start_rows: torch.Tensor  # [G] int32
    end_rows: torch.Tensor  # [G] int32
    slot_ids: torch.Tensor  # [G] int32

    @classmethod
    def of_rows(
        cls, rows: Sequence[tuple[int, int | None]], device: torch.device
    ) -> LoraSegments | None:
        """Segments of consecutive rows under the same slot, from ``(row count, slot)`` per
        sequence in batch order (slot None: the base model). None when no row has an adapter."""
        starts: list[int] = []
        ends: list[int] = []
        slots: list[int] = []
        row = 0
        for count, slot in rows:
            if slot is not None and count:
                if slots and slots[-1] == slot and ends[-1] == row:
                    ends[-1] = row + count
                else:
                    starts.append(row)
                    ends.append(row + count)
                    slots.append(slot)
            row += count
        if not slots:
            return None
        table = torch.tensor([starts, ends, slots], dtype=torch.int32).to(device)
        return cls(starts, ends, slots, table[0], table[1], table[2])

    @property
    def max_rows(self) -> int:
        return max(end - start for start, end in zip(self.starts, self.ends, strict=True))


def lora_delta_reference(
    out: torch.Tensor,  # [N, out_features], updated in place
    x: torch.Tensor,  # [N, in_features]
    a: torch.Tensor,  # [slots, R, in_features]
    b: torch.Tensor,  # [slots, out_features, R]
    scales: torch.Tensor,  # [slots] float32
    segments: LoraSegments,
) -> None:
    """Add each segment's delta to its rows of ``out``: the shrink and the expand in ``x``'s
    dtype, then the scale, rounded to ``out``'s dtype once (PEFT's order)."""
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        shrunk = x[start:end] @ a[slot].t()
        out[start:end] += ((shrunk @ b[slot].t()) * scales[slot]).to(out.dtype)
