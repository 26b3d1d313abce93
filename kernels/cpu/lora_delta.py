"""Batched LoRA's C kernel on the CPU (``kernels/cpu/lora_delta.c``): each segment's delta added
to a projection's bf16 output, one row at a time in one order, so a row's bits do not depend on
the batch. The module path (``common/model/lora_layers.py``) and the C decoder layer
(``kernels/cpu/layer.py``) both run it, which keeps the two paths' bits equal under adapters.

In a decode step this is what makes adapters cheap on a CPU: torch's matmuls over every slot
(``kernels/lora.py``'s ``lora_delta_dense``) cost tens of microseconds a projection in calls and
in arithmetic over slots no row uses, and they kept a step off the C decoder layer. A decode
step reads each adapter it serves whole, so the slots are bf16, as the model's weights are:
half float32's bytes. The sums are float32 (the shrunk columns too, not rounded between the
shrink and the expand), rounded once to bf16 before the add, as ``lora_delta_reference`` rounds.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import library as cpu_library
from kernels.lora import LoraSegments

# exports.h's LORA_MAX_TARGETS and LORA_MAX_RANK_ROWS.
MAX_TARGETS = 3
MAX_RANK_ROWS = 1536


class LoraWeights(ctypes.Structure):
    """``lora_weights`` of exports.h, field by field."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("num_targets", ctypes.c_int32),
        ("max_rank", ctypes.c_int32),
        ("out_starts", ctypes.c_int32 * MAX_TARGETS),
        ("out_sizes", ctypes.c_int32 * MAX_TARGETS),
    ]


def lora_weights(
    a: torch.Tensor,  # [slots, targets * max_rank, in_features] bf16, contiguous
    b: torch.Tensor,  # [slots, targets * max_rank, out_features] bf16, contiguous
    scales: torch.Tensor,  # [slots] float32
    max_rank: int,
    out_sizes: list[int],  # each target's output columns, in order
) -> LoraWeights | None:
    """The C kernel's view of one projection's slots, or None where it does not take them
    (not bf16 host tensors, or more targets or rank rows than it holds). The tensors must
    outlive the view and keep their storage: slots are rewritten in place."""
    tensors = (a, b, scales)
    if (
        any(t.device.type != "cpu" for t in tensors)
        or a.dtype != torch.bfloat16
        or b.dtype != torch.bfloat16
        or scales.dtype != torch.float32
        or not all(t.is_contiguous() for t in tensors)
        or not 1 <= len(out_sizes) <= MAX_TARGETS
        or a.shape[1] != len(out_sizes) * max_rank
        or a.shape[1] > MAX_RANK_ROWS
        or not cpu_library.available()
    ):
        return None
    starts = [sum(out_sizes[:index]) for index in range(len(out_sizes))]
    padding = [0] * (MAX_TARGETS - len(out_sizes))
    return LoraWeights(
        a=a.data_ptr(),
        b=b.data_ptr(),
        scales=scales.data_ptr(),
        num_targets=len(out_sizes),
        max_rank=max_rank,
        out_starts=(ctypes.c_int32 * MAX_TARGETS)(*starts, *padding),
        out_sizes=(ctypes.c_int32 * MAX_TARGETS)(*out_sizes, *padding),
    )


def takes_rows(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernel adds to ``out`` for ``x``: bf16 host rows, each contiguous."""
    return (
        out.dtype == x.dtype == torch.bfloat16
        and out.device.type == x.device.type == "cpu"
        and out.dim() == x.dim() == 2
        and out.stride(1) == x.stride(1) == 1
    )


def segment_args(segments: LoraSegments) -> tuple[int, int, int, int]:
    """The kernel's segment arguments: pointers to the starts, ends and slots (int32 host
    tensors of the segments) and their count."""
    return (
        segments.start_rows.data_ptr(),
        segments.end_rows.data_ptr(),
        segments.slot_ids.data_ptr(),
        len(segments.slots),
    )


def lora_delta_bf16(
    out: torch.Tensor,  # [N, out_features] bf16, updated in place
    x: torch.Tensor,  # [N, in_features] bf16
    weights: LoraWeights,
    segments: LoraSegments,
) -> None:
    """``lora_delta_reference``'s sum, each row's arithmetic in float32 on its own."""
    assert takes_rows(out, x) and segments.start_rows.device.type == "cpu"
    status = cpu_library.load().pdserve_lora_delta_bf16(
        ctypes.addressof(weights),
        *segment_args(segments),
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        out.shape[1],
        x.shape[1],
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError("the LoRA slots are beyond what the C kernel holds")
