"""Batched LoRA: the rows of one forward grouped by adapter, and the torch twin of the kernels
that add each group's low-rank delta to a projection's output.

A forward's rows are flattened sequence by sequence; sequences under the same adapter that sit
side by side form one **segment**. A projection's adapters live in slots of two stacked
tensors: ``a [slots, R, in]`` and ``b [slots, R, out]`` (B transposed: a rank's row of
outputs is contiguous), where ``R`` is the largest rank the engine serves times the projection's
slices (q, k and v share one projection: their A's are stacked along ``R`` and their B's laid
block-diagonally, so one shrink and one expand serve all three). A smaller rank is zero-padded,
which adds nothing. For every segment

    out[rows] += (x[rows] @ a[slot].T) @ b[slot] * scale[slot]

— Punica's SGMV: a *shrink* to ``R`` columns, an *expand* back to ``out``. Rows of the base
model belong to no segment and are left as they are. ``kernels/triton/lora.py`` is the CUDA
pair; ``lora_delta_reference`` below, per segment with torch matmuls, is its twin.

On the CPU a bf16 model's slots are bf16 and ``kernels/cpu/lora_delta.c`` adds the deltas. For
other dtypes, where each torch call costs microseconds of its own, ``lora_delta_dense`` computes
every row against every slot at once (two matmuls a projection, however many adapters): each
row's shrunk columns are weighed by its slot's scale and zero elsewhere, so it takes only its
own adapter's delta and a base model's row none. It multiplies ``slots`` times the shrink's
arithmetic, so the CPU takes it while ``slots * R`` is at most ``DENSE_MAX_COLUMNS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The widest ``slots * R`` the CPU computes densely (see the module's docstring).
DENSE_MAX_COLUMNS = 512


@dataclass(frozen=True, eq=False)
class LoraSegments:
    """Which adapter slot each run of a forward's rows computes under: built once per step by
    the runner, read by every LoRA projection of every layer. Rows outside every segment are
    the base model's."""

    starts: list[int]  # [G] first row of each segment, ascending
    ends: list[int]  # [G] one past its last row
    slots: list[int]  # [G] its adapter's slot
    num_rows: int  # N: the forward's rows, of every segment and of none
    # The same three as int32 tensors on the forward's device, for the kernels.
    start_rows: torch.Tensor  # [G] int32
    end_rows: torch.Tensor  # [G] int32
    slot_ids: torch.Tensor  # [G] int32
    # (slots, R) -> [N, slots * R] float32: lora_delta_dense's weights, made once per step.
    _row_weights: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

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
        return cls(starts, ends, slots, row, table[0], table[1], table[2])

    def row_weights(self, scales: torch.Tensor, rank: int) -> torch.Tensor:
        """``[N, slots * rank]`` float32: each row's slot's scale over that slot's ``rank``
        columns, zero elsewhere (a base model's row: zero throughout). ``scales [slots]`` are
        per adapter slot, the same in every projection, so one tensor serves each ``rank``."""
        key = (scales.shape[0], rank)
        weights = self._row_weights.get(key)
        if weights is None:
            per_slot = torch.zeros(self.num_rows, scales.shape[0], device=scales.device)
            for start, end, slot in zip(self.starts, self.ends, self.slots, strict=True):
                per_slot[start:end, slot] = scales[slot]
            weights = self._row_weights[key] = per_slot.repeat_interleave(rank, dim=1)
        return weights

    @property
    def max_rows(self) -> int:
        return max(end - start for start, end in zip(self.starts, self.ends, strict=True))


def lora_delta_reference(
    out: torch.Tensor,  # [N, out_features], updated in place
    x: torch.Tensor,  # [N, in_features]
    a: torch.Tensor,  # [slots, R, in_features]
    b: torch.Tensor,  # [slots, R, out_features]
    scales: torch.Tensor,  # [slots] float32
    segments: LoraSegments,
) -> None:
    """Add each segment's delta to its rows of ``out``: the shrink and the expand in the slots'
    dtype (``x`` cast to it), then the scale, rounded to ``out``'s dtype once (PEFT's order).
    On a CPU this serves float32 slots (a bf16 model's take the C kernel): torch's 16-bit
    matmuls of these thin shapes are many times slower there than float32's."""
    for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
        shrunk = x[start:end].to(a.dtype) @ a[slot].t()
        out[start:end] += ((shrunk @ b[slot]) * scales[slot]).to(out.dtype)


def lora_delta_dense(
    out: torch.Tensor,  # [N, out_features], updated in place
    x: torch.Tensor,  # [N, in_features]
    a: torch.Tensor,  # [slots, R, in_features], contiguous
    b: torch.Tensor,  # [slots, R, out_features], contiguous
    scales: torch.Tensor,  # [slots] float32
    segments: LoraSegments,
) -> None:
    """``lora_delta_reference``'s sum as two matmuls over every slot (the module's docstring):
    the scale is applied to the shrunk columns, before the expand."""
    slots, rank, in_features = a.shape
    shrunk = x.to(a.dtype) @ a.view(slots * rank, in_features).t()
    shrunk *= segments.row_weights(scales, rank)
    out += (shrunk @ b.view(slots * rank, -1)).to(out.dtype)
