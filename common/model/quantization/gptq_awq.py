"""GPTQ and AWQ checkpoints in their own formats (AutoGPTQ / GPTQModel, AutoAWQ's GEMM layout):
4- or 8-bit integers in groups along the input, a scale and a zero point per group and output
column, packed in int32 words. Each is a repacking into ``QuantizedWeight`` with no loss.

GPTQ: ``qweight [K * bits / 32, N]`` packs along the input, value ``i`` of a word at bit
``i * bits``; ``qzeros [G, N * bits / 32]`` along the output the same way; ``scales [G, N]``;
``g_idx [K]`` each input's group. ``w = scale (q - z)``, where the original format
(``checkpoint_format: gptq``) stores ``z - 1`` and ``gptq_v2`` stores ``z``. Groups in
activation order (``desc_act`` with a ``g_idx`` that is not ``k // group_size``) are refused.

AWQ (``version: gemm``): ``qweight [K, N / 8]`` packs eight output columns into a word in the
order 0, 2, 4, 6, 1, 3, 5, 7 (column ``ORDER[i]`` at bit ``4 i``); ``qzeros [G, N / 8]`` alike;
``scales [G, N]``. ``w = scale (q - z)``.
"""

from __future__ import annotations

from typing import Any

import torch

from common.model.quantization.compressed_tensors import HEAD, LINEAR_LAYERS, QuantizedLinearTensors
from kernels.quantized import INT8, UINT4, QuantizedWeight
from kernels.sizes import ceil_div

GPTQ = "gptq"
AWQ = "awq"
TENSOR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
# The output column each 4-bit field of an AWQ word holds, field by field from bit 0.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class PackedIntConfig:
    """A GPTQ or AWQ ``quantization_config``, checked at load."""

    def __init__(self, method: str, bits: int, group_size: int, zero_offset: int) -> None:
        self.method = method
        self.bits = bits
        self.group_size = group_size  # -1: one group per row
        # What the stored zero point is short of the real one (original GPTQ: 1).
        self.zero_offset = zero_offset

    @classmethod
    def from_dict(cls, raw: Any) -> PackedIntConfig:
        where = "quantization_config"
        method = raw.get("quant_method")
        bits = raw.get("bits", raw.get("w_bit"))
        group_size = raw.get("group_size", raw.get("q_group_size"))
        if not (isinstance(group_size, int) and (group_size > 0 or group_size == -1)):
            raise ValueError(f"{where}.group_size must be a positive integer or -1")
        if method == GPTQ:
            if bits not in (4, 8):
                raise ValueError(f"{where}.bits {bits!r}: pdserve reads 4- and 8-bit GPTQ")
            checkpoint_format = raw.get("checkpoint_format", "gptq")
            if checkpoint_format not in ("gptq", "gptq_v2"):
                raise ValueError(f"{where}.checkpoint_format {checkpoint_format!r} is not read")
            return cls(GPTQ, bits, group_size, 1 if checkpoint_format == "gptq" else 0)
        if method == AWQ:
            if bits != 4:
                raise ValueError(f"{where}.bits {bits!r}: AWQ checkpoints are 4-bit")
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}.version {version!r}: pdserve reads AWQ's GEMM layout")
            if raw.get("zero_point", True) is not True:
                raise ValueError(f"{where}.zero_point: AWQ without zero points is not read")
            return cls(AWQ, 4, group_size, 0)
        raise ValueError(f"{where}.quant_method {method!r} is neither gptq nor awq")

    @staticmethod
    def quantizes(layer: str) -> bool:
        """Whether linear layer ``layer`` is stored packed (every decoder layer's linears; the
        head stays 16-bit in both formats)."""
        return layer != HEAD and layer.rpartition(".")[2] in LINEAR_LAYERS

    def layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> QuantizedLinearTensors:
        try:
            weight = self._weight(tensors)
        except KeyError as exc:
            raise ValueError(f"quantized layer {layer}: missing {exc}") from exc
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"quantized layer {layer}: {exc}") from exc
        return QuantizedLinearTensors(weight, None)

    def _weight(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        scales = tensors["scales"].float()
        groups, columns = scales.shape
        qweight, qzeros = tensors["qweight"], tensors["qzeros"]
        if self.method == GPTQ:
            rows = qweight.shape[0] * 32 // self.bits
            codes = _unpacked(qweight.t(), self.bits)[:, :rows]  # [N, K]
            zeros = _unpacked(qzeros, self.bits)[:, :columns].t()  # [N, G]
        else:
            rows = qweight.shape[0]
            codes = _awq_columns(_unpacked(qweight, 4)).t()[:columns]
            zeros = _awq_columns(_unpacked(qzeros, 4))[:, :columns].t()
        group = rows if self.group_size == -1 else self.group_size
        if ceil_div(rows, group) != groups:
            raise ValueError(f"scales hold {groups} groups, {rows} inputs in groups of {group}")
        if "g_idx" in tensors:
            expected = torch.arange(rows, dtype=torch.int64) // group
            if not torch.equal(tensors["g_idx"].to(torch.int64), expected):
                raise ValueError("g_idx: groups in activation order (desc_act) are not read")
        scales = scales.t().contiguous()
        offsets = scales * (zeros.float() + self.zero_offset)
        if self.bits == 4:
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            return QuantizedWeight(UINT4, packed.contiguous(), scales, offsets, group, rows)
        # Unsigned 8-bit codes: shifted by 128 into int8, the offsets by the same.
        signed = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        return QuantizedWeight(INT8, signed, scales, offsets - 128 * scales, group, rows)


def _unpacked(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, W]`` -> uint8 ``[R, W * 32 / bits]``: field ``i`` of word ``w`` (from bit
    0) at column ``w * 32 / bits + i``."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed tensors are int32, got {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.contiguous()[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2).to(torch.uint8)


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """AWQ's fields put back in column order: field ``i`` of each word holds column
    ``AWQ_PACK_ORDER[i]`` of its eight."""
    inverse = torch.argsort(torch.tensor(AWQ_PACK_ORDER))
    order = (torch.arange(unpacked.shape[-1]).view(-1, 8)[:, inverse]).flatten()
    return unpacked[..., order]
