"""A llama GGUF's tensors under their Hugging Face names, quantized ones as ``QuantizedWeight``.

Each GGML block format below is translated into codes, scales and offsets with nothing rounded:
``QuantizedWeight.dequantize()`` of the result equals ``gguf.quants.dequantize`` of the block
bytes. Every block's scale is an fp16 (times a small integer in the K-quants), so the float32
scales and offsets are exact, and the scale-times-code arithmetic is the one llama.cpp does.

    type   codes  group  scale    offset   (llama.cpp's value)
    Q8_0   INT8   32     d        -        d * q
    Q4_0   UINT4  32     d        8 d      d * (q - 8)
    Q4_1   UINT4  32     d        -m       d * q + m
    Q4_K   UINT4  32     d sc     dmin m   d sc q - dmin m   (sc, m: 6 bits per 32 in 256)
    Q6_K   INT8   16     d sc     -        d sc (q - 32)     (code q - 32; sc: int8 per 16)
    Q5_0   INT8   32     d        -        d * (q - 16)      (code q - 16)
    Q5_1   INT8   32     d        -m       d * q + m
    Q5_K   INT8   32     d sc     dmin m   d sc q - dmin m

The 5-bit codes do not fit ``UINT4`` and are held as int8: exact, at 8 bits a weight.

The file is memory-mapped; each tensor is copied once, into its codes (the block formats
interleave scales and codes, which no kernel reads in place).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import Q4_K

from common.model.gguf_llama import (
    BLOCK_TYPES,
    DENSE_TYPES,
    check_gguf_weights,
    hf_tensor_name,
    llama_config,
    rope_heads,
    unpermute_rope_rows,
)
from kernels.quantized import INT8, UINT4, QuantizedWeight

if TYPE_CHECKING:
    pass


def read_gguf_weights(
    path: str | os.PathLike[str],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the llama GGUF at `path`, under its Hugging Face name, ``[out, in]``.

    F32, F16 and BF16 tensors come as dense tensors of that dtype; the block formats in
    ``_TRANSLATIONS`` as ``QuantizedWeight``. q/k projection rows are put back in Hugging Face
    order (whole rows move: codes and their scales together). A tensor of any other type is
    refused with a ValueError naming it, before anything is yielded.
    """
    reader = GGUFReader(path)
    config = llama_config(reader)
    check_gguf_weights(reader, config)  # every tensor of a type read here, before any is read
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = _read_tensor(tensor)
        num_heads = rope_heads(name, config)
        if num_heads is not None:
            weight = _take_rows(weight, _unpermuted_row_order(weight.shape[0], num_heads))
        yield name, weight


def _read_tensor(tensor: ReaderTensor) -> torch.Tensor | QuantizedWeight:
    kind = tensor.tensor_type
    if kind.name in DENSE_TYPES:
        # The reader hands BF16 over as raw bytes; F32 and F16 come typed.
        data = np.array(tensor.data)  # a writable copy out of the read-only mapping
        if kind == GGMLQuantizationType.BF16:
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(data)
    # numpy's shape is the reverse of GGUF's dims: [out, bytes of a row], a row being whole blocks.
    rows = tensor.data.shape[0]
    in_features = int(tensor.shape[0])
    _, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = tensor.data.reshape(rows, -1, block_bytes)
    return _TRANSLATIONS[kind](blocks, in_features)


def _unpermuted_row_order(rows: int, num_heads: int) -> torch.Tensor:
    order = unpermute_rope_rows(np.arange(rows).reshape(rows, 1), num_heads)
    return torch.from_numpy(np.ascontiguousarray(order[:, 0]))


def _take_rows(
    weight: torch.Tensor | QuantizedWeight, order: torch.Tensor
) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, torch.Tensor):
        return weight[order]
    offsets = None if weight.offsets is None else weight.offsets[order]
    return replace(weight, codes=weight.codes[order], scales=weight.scales[order], offsets=offsets)


# --- the block formats -----------------------------------------------------------------------
# Each translation takes one tensor's blocks, uint8 [rows, blocks per row, bytes per block], as
# llama.cpp lays them out (ggml-common.h), and its row width.


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """[rows, blocks] float32: the fp16 at bytes ``start:start + 2`` of every block."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _nibbles(packed: np.ndarray, halves: int = 1) -> np.ndarray:
    """4-bit values from bytes [..., halves * n]: each run of n bytes holds 2n values, its low
    nibbles first, then its high ones (llama.cpp's order). Returns uint8 [..., halves * 2n]."""
    runs = packed.reshape(*packed.shape[:-1], halves, 1, -1)
    values = np.concatenate((runs & 0x0F, runs >> 4), axis=-2)
    return values.reshape(*packed.shape[:-1], -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit i of a block's little-endian uint32 ``qh`` [..., 4] as value i (Q5_0, Q5_1)."""
    words = np.ascontiguousarray(qh).view("<u4")
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _uint4(
    codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, group: int, k: int
) -> QuantizedWeight:
    flat = codes.reshape(codes.shape[0], k)
    packed = flat[:, 0::2] | (flat[:, 1::2] << 4)  # column 2j low, 2j + 1 high
    return _weight(UINT4, packed, scales, offsets, group, k)


def _int8(
    codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, group: int, k: int
) -> QuantizedWeight:
    return _weight(INT8, codes.reshape(codes.shape[0], k).view(np.int8), scales, offsets, group, k)


def _weight(
    kind: str,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray | None,
    group: int,
    k: int,
) -> QuantizedWeight:
    rows = codes.shape[0]

    def as_tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    return QuantizedWeight(
        kind=kind,
        codes=as_tensor(codes),
        scales=as_tensor(scales.reshape(rows, -1)),
        offsets=None if offsets is None else as_tensor(offsets.reshape(rows, -1)),
        group_size=group,
        in_features=k,
    )


def _q8_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d: fp16, then 32 int8 codes.
    return _int8(blocks[..., 2:], _fp16_field(blocks, 0), None, 32, k)


def _q4_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d, then 16 bytes of 4-bit q; w = d (q - 8) = d q - 8 d, both exact in float32.
    d = _fp16_field(blocks, 0)
    return _uint4(_nibbles(blocks[..., 2:]), d, 8 * d, 32, k)


def _q4_1(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d, m, then 16 bytes of 4-bit q; w = d q + m.
    d, m = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    return _uint4(_nibbles(blocks[..., 4:]), d, -m, 32, k)


def _q5_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d, 32 high bits, then 16 bytes of low nibbles; w = d (q - 16).
    q = _nibbles(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6]) << 4)
    return _int8(q.astype(np.int8) - 16, _fp16_field(blocks, 0), None, 32, k)


def _q5_1(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d, m, 32 high bits, then 16 bytes of low nibbles; w = d q + m.
    q = _nibbles(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8]) << 4)
    return _int8(q, _fp16_field(blocks, 0), -_fp16_field(blocks, 2), 32, k)


def _k_quant_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales and offsets [rows, blocks, 8] of a Q4_K/Q5_K super-block's eight groups of 32:
    d times each group's 6-bit scale, dmin times its 6-bit min (12 packed bytes at 4:16)."""
    rows, count = blocks.shape[:2]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    sc, m = sc.reshape(rows, count, 8), m.reshape(rows, count, 8)
    return d[..., None] * sc.astype(np.float32), dmin[..., None] * m.astype(np.float32)


def _q4_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # d, dmin, 12 bytes of scales and mins, then 4 runs of 32 bytes, each 64 4-bit q.
    scales, offsets = _k_quant_groups(blocks)
    return _uint4(_nibbles(blocks[..., 16:], halves=4), scales, offsets, 32, k)


def _q5_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # As Q4_K, with 32 bytes of high bits before the nibbles: bit j of byte i is the fifth bit
    # of q in group j, position i.
    scales, offsets = _k_quant_groups(blocks)
    qh = blocks[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _nibbles(blocks[..., 48:], halves=4) | (high.reshape(*qh.shape[:-1], -1) << 4)
    return _int8(q, scales, offsets, 32, k)


def _q6_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16), then d.
    rows, count = blocks.shape[:2]
    low = _nibbles(blocks[..., :128], halves=2).reshape(rows, count, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(rows, count, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = (low | (high << 4)).astype(np.int8) - 32
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return _int8(q, _fp16_field(blocks, 208)[..., None] * sc, None, 16, k)


_TRANSLATIONS: dict[GGMLQuantizationType, Callable[[np.ndarray, int], QuantizedWeight]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
# The types the torch-free check at a folder's writing lets through are the ones read here.
assert {kind.name for kind in _TRANSLATIONS} == set(BLOCK_TYPES), "BLOCK_TYPES drifted"
