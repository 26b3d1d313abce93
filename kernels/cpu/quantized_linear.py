"""Linear layers over quantized weights on the CPU: int8, 4-bit and FP8 codes read as they are.

A ``QuantizedWeight`` (``kernels/quantized.py``) is prepacked once into tiles of 32 output
columns (``pack_quantized_tiles``), and a tile kernel reads its codes as it streams them: a
decode step reads one byte a weight (half of one for 4-bit codes) where a bf16 model reads two,
and memory is what bounds it. Two kernels:

- **integer sums** (``kernels/cpu/quantized_quads.c``), for int8 and 4-bit codes where the
  processor has AVX512_VNNI: the input rows are scaled to integers and multiplied with the codes
  in the processor's byte dot products, 64 products an instruction, exactly. No code is widened,
  so a decode step streams the codes at memory speed, and with many rows they do 2-3 times the
  float32 FMAs' work an instruction: on a 2-core AVX-512 Xeon they ran SmolLM2's linears at
  batch 32 and in 512- and 2048-row prefill at 0.5-0.8x the time of its bf16 weights (the
  float32 BLAS). They take every row count there.
- **float32 tiles** (``kernels/cpu/quantized_tiles.c``), for FP8 codes, and int8 or 4-bit codes
  elsewhere: each code widened to float32 as it is read, then FMAs. Prefill chunks are bound by
  arithmetic, where these do the work of the bf16 tiles plus the widening: past
  ``TILE_MAX_ROWS`` rows the weight is dequantized into a scratch buffer shared by every layer
  and multiplied by torch's GEMM.

Each output is summed in one fixed order whatever the row count (the integer sums in no order at
all, being exact), like the bf16 tiles (``kernels/cpu/linear.py``), so a sequence's tokens do
not depend on the batch. Which BLAS the dequantized weight goes to follows what
``kernels/cpu/linear.py``'s probe finds on each kind of processor: bf16 (oneDNN) where there is
AMX, several times faster than float32 there, the weight then rounded to bf16 as a bf16
checkpoint of the model would be (the integer sums too give way to it there, untimed); float32
(MKL, over the weight transposed, the layout it runs fastest) elsewhere, where oneDNN's bf16 runs
at half MKL's speed or slower. Decode and verification steps (``short_runs_only``) and
deterministic inference (``tiles_only``) take the tiles at every row count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import library as cpu_library
from kernels.cpu.activation_rounding import KIND_CODES, activation_rounding, round_activations
from kernels.cpu.backend import KV_DTYPE_CODES
from kernels.cpu.features import has_amx_bf16
from kernels.cpu.linear import BF16_BLAS, FLOAT32_BLAS, TILE, TILE_DTYPES, StepShape
from kernels.quantized import FP8_E4M3, INT8, UINT4, ActivationQuantization, QuantizedWeight
from kernels.sizes import ceil_div

# Input columns a byte dot product sums at once; and the kernels' codes of integer codes in
# quads of k-rows (kernels/cpu/exports.h's quantized_code).
QUAD = 4
QUAD_CODES = {INT8: 3, UINT4: 4}
# "0": int8 and 4-bit codes take the float32 tiles even where the integer sums run. Their
# outputs differ in the last bits (bf16 rows are rounded to integers at 2^-14 of their largest
# value), so every process of a machine must read the same setting, as it does
# PDSERVE_CPU_BF16_TILES (kernels/cpu/tile_choice.py).
ENV_INTEGER_SUMS = "PDSERVE_CPU_INTEGER_SUMS"
# The tile kernel decodes an e4m3 code as an fp16 of 1/256 its value (exact); its scale holds
# the 256.
FP8_DECODE_SCALE = 256.0
# Past this many rows the float32 tiles dequantize the weight and run torch's GEMM, by the BLAS
# it runs. float32 MKL: on the 2-core AVX-512 Xeon (AVX512_BF16, no AMX), one thread, SmolLM2's
# gate_up (3072 x 576) and down (576 x 1536), int8 in groups of 32 and uint4 in groups of 64:
# at 256 rows the tiles took 0.78-0.98x the time of dequantizing and MKL, at 512 0.86-1.10x
# (even), at 128 and fewer 0.78-0.81x. The integer sums beat float32 MKL at every row count
# there (SmolLM2's linears, 512 and 2048 rows: 0.50-0.81x of the bf16 model's BLAS, where
# dequantizing and MKL took 1.0-1.4x). bf16 oneDNN on AMX runs prefill-sized GEMMs 5-8x faster
# than float32 MKL (kernels/cpu/linear.py), so there the tiles give way where bf16 models' do
# (unmeasured with quantized weights; the bf16 probe's smallest BLAS row count).
TILE_MAX_ROWS = {FLOAT32_BLAS: 256, BF16_BLAS: 32}


@dataclass(frozen=True, slots=True)
class QuantizedTiles:
    """A ``QuantizedWeight`` as the tile kernels read it: ``tiles`` uint8 ``[ceil(N / 32),
    tile_bytes]``, each row one tile's groups in order (scales, offsets, codes)."""

    tiles: torch.Tensor
    kind: str
    code: int  # the kernels' quantized_code: the codes' kind and layout
    group_size: int
    has_offsets: bool
    out_features: int
    in_features: int

    @property
    def integer_sums(self) -> bool:
        """Whether the integer sums read these tiles (else the float32 tiles do)."""
        return self.code in QUAD_CODES.values()


def integer_sums_fit(weight: QuantizedWeight) -> bool:
    """Whether this machine can sum ``weight``'s codes in integers (``quantized_quads.c``): int8
    or 4-bit codes in groups of whole quads of input columns (or one group a row), on a
    processor with AVX512_VNNI."""
    whole_quads = weight.group_size % QUAD == 0 or weight.group_size >= weight.in_features
    return (
        weight.kind in QUAD_CODES
        and whole_quads
        and bool(cpu_library.load().pdserve_quantized_quads_available())
    )


def integer_sums_wanted() -> bool:
    """Whether the integer sums are on (``ENV_INTEGER_SUMS``; the default)."""
    return os.environ.get(ENV_INTEGER_SUMS, "1") != "0"


def pack_quantized_tiles(
    weight: QuantizedWeight, integer_sums: bool | None = None
) -> QuantizedTiles:
    """``weight`` in tiles of 32 output columns: per tile and group, the scales and offsets of
    its 32 columns, then its codes, k-major for the float32 tiles
    (``kernels/cpu/quantized_tiles.c``) or in quads of k-rows for the integer sums
    (``kernels/cpu/quantized_quads.c``; ``integer_sums``, by default wherever they fit); columns
    past N hold zero codes and scales."""
    if integer_sums is None:
        integer_sums = integer_sums_wanted() and integer_sums_fit(weight)
    elif integer_sums and not integer_sums_fit(weight):
        raise ValueError(
            f"{weight.kind} codes in groups of {weight.group_size} cannot be summed in integers "
            "on this machine"
        )
    if integer_sums:
        return pack_quads(weight)
    if weight.kind == UINT4 and weight.group_size % 2:
        raise ValueError(
            f"4-bit codes pair two input columns in a byte; a group of {weight.group_size} "
            "would split a pair"
        )
    num_tiles = ceil_div(weight.shape[0], TILE)
    values = nibbles(weight) if weight.kind == UINT4 else weight.codes.view(torch.uint8)
    # [N, K_pad] -> [tiles, K_pad, 32]: each tile's k-rows of 32 columns.
    tiles = padded_columns(values, num_tiles).transpose(1, 2)
    if weight.kind == UINT4:
        tiles = tiles[:, 0::2] | (tiles[:, 1::2] << 4)
    code_rows = weight.group_size // 2 if weight.kind == UINT4 else weight.group_size
    groups = ceil_div(weight.in_features, weight.group_size)
    codes = [
        tiles[:, group * code_rows : (group + 1) * code_rows].reshape(num_tiles, -1)
        for group in range(groups)
    ]
    scale = FP8_DECODE_SCALE if weight.kind == FP8_E4M3 else 1.0
    return tiles_of(weight, KIND_CODES[weight.kind], codes, scale)


def pack_quads(weight: QuantizedWeight) -> QuantizedTiles:
    """``weight`` in tiles for the integer sums (the layout is described in
    ``kernels/cpu/quantized_quads.c``): per group, its scales (and offsets), then its codes in
    quads of k-rows, the last group padded with zero codes to a whole quad."""
    num_tiles = ceil_div(weight.shape[0], TILE)
    values = weight.codes.view(torch.uint8) if weight.kind == INT8 else nibbles(weight)
    values = padded_columns(values[:, : weight.in_features], num_tiles).flatten(0, 1)
    codes = []
    for k0 in range(0, weight.in_features, weight.group_size):
        part = values[:, k0 : k0 + weight.group_size]
        rows = ceil_div(part.shape[1], QUAD) * QUAD
        part = F.pad(part, (0, rows - part.shape[1]))
        # [tiles, half h, column j, quad q, row i]: column 16 h + j's code of k-row 4 q + i.
        part = part.reshape(num_tiles, 2, 16, rows // QUAD, QUAD)
        if weight.kind == INT8:
            group_codes = part.permute(0, 3, 1, 2, 4)  # byte 64 h + 4 j + i of each quad
        else:
            group_codes = (part[:, 0] | (part[:, 1] << 4)).permute(0, 2, 1, 3)  # byte 4 j + i
        codes.append(group_codes.reshape(num_tiles, -1))
    return tiles_of(weight, QUAD_CODES[weight.kind], codes)


def nibbles(weight: QuantizedWeight) -> torch.Tensor:
    """4-bit codes ``[N, ceil(K / 2)]``, two a byte, as ``[N, K_pad]``, one a byte (K_pad even)."""
    pairs = weight.codes.view(torch.uint8)
    return torch.stack((pairs & 0x0F, pairs >> 4), dim=-1).flatten(1)


def padded_columns(values: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """``[N, ...]`` as ``[tiles, 32, ...]``, the output columns past N zero."""
    pad_n = num_tiles * TILE - values.shape[0]
    return F.pad(values, (0, 0, 0, pad_n)).view(num_tiles, TILE, *values.shape[1:])


def tiles_of(
    weight: QuantizedWeight, code: int, codes: list[torch.Tensor], scale: float = 1.0
) -> QuantizedTiles:
    """The tiles of ``weight`` for the kernel of ``code``: per tile, each group's header (its
    scales, times ``scale``, and offsets over the tile's 32 columns) then that group's
    ``codes`` (``[tiles, bytes]`` each, in the kernel's layout)."""
    columns = [weight.scales * scale]
    if weight.offsets is not None:
        columns.append(weight.offsets)
    num_tiles = codes[0].shape[0]
    # [N, groups] -> [tiles, groups, 32 * len(columns)] as bytes: each group's header.
    headers = torch.cat(
        [padded_columns(part.float(), num_tiles).transpose(1, 2) for part in columns], dim=2
    )
    headers = headers.contiguous().view(torch.uint8)
    blocks = []
    for group, group_codes in enumerate(codes):
        blocks += [headers[:, group], group_codes]
    packed = torch.cat(blocks, dim=1).contiguous()
    expected = cpu_library.load().pdserve_quantized_tile_bytes(
        code, weight.group_size, int(weight.offsets is not None), weight.in_features
    )
    assert packed.shape[1] == expected, (packed.shape, expected)
    return QuantizedTiles(
        tiles=packed,
        kind=weight.kind,
        code=code,
        group_size=weight.group_size,
        has_offsets=weight.offsets is not None,
        out_features=weight.shape[0],
        in_features=weight.in_features,
    )


class WeightScratch:
    """One buffer that dequantized weights borrow in turn (layers run one at a time), grown to
    the largest asked for: a prefill step needs one layer's weight in the model's dtype at a
    time, not the whole model's."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def borrow(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` over the buffer, valid until the next ``borrow``."""
        count = shape[0] * shape[1]
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < count:
            buffer = self.buffers[dtype] = torch.empty(count, dtype=dtype)
        return buffer[:count].view(shape)


SHARED_SCRATCH = WeightScratch()


class CpuQuantizedLinear(nn.Module):
    """``y = x W^T + b`` in the model's dtype (bf16 or float32) over a quantized ``W``, the
    input first rounded as the checkpoint's activations are (``activations``), if they are."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        step: StepShape | None = None,
        activations: ActivationQuantization | None = None,
        tiles_only: bool = False,
        scratch: WeightScratch = SHARED_SCRATCH,
        integer_sums: bool | None = None,
    ) -> None:
        super().__init__()
        if dtype not in TILE_DTYPES:
            raise ValueError(f"quantized linear layers run in bf16 or float32, not {dtype}")
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.step = step or StepShape()
        self.activations = activations
        self.rounding = activation_rounding(activations)
        self.tiles_only = tiles_only
        self.scratch = scratch
        self.packed = pack_quantized_tiles(weight.to(torch.device("cpu")), integer_sums)
        self.bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.bias_in_dtype = None if bias is None else bias.detach().to(dtype).contiguous()
        bf16_blas = dtype == torch.bfloat16 and has_amx_bf16()
        self.blas_dtype = BF16_BLAS if bf16_blas else FLOAT32_BLAS
        # Past this many rows the weight is dequantized for the BLAS; None: never.
        self.tile_max_rows = (
            None if self.packed.integer_sums and not bf16_blas else TILE_MAX_ROWS[self.blas_dtype]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            self._check_input(x)
            x = round_activations(self.rounding, x if x.stride(-1) == 1 else x.contiguous())
        short = self.tile_max_rows is None or x.shape[0] <= self.tile_max_rows
        if self.tiles_only or short or self.step.short_runs_only:
            return self.forward_tiles(x)
        return self.forward_dequantized(x)

    def forward_tiles(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=self.dtype)
        packed = self.packed
        status = cpu_library.load().pdserve_quantized_linear(
            x.data_ptr(),
            x.stride(0),
            packed.tiles.data_ptr(),
            packed.code,
            packed.group_size,
            int(packed.has_offsets),
            None if self.bias32 is None else self.bias32.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            KV_DTYPE_CODES[self.dtype],
            x.shape[0],
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the quantized tile GEMM could not allocate its scratch memory")
        return out

    def forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """The weight dequantized into the shared scratch buffer, then torch's GEMM."""
        self._check_input(x)
        if self.blas_dtype == BF16_BLAS:
            return F.linear(x, self.dequantize_into_scratch(), self.bias_in_dtype)
        weight_t = self.dequantize_into_scratch(transposed=True)
        x32 = x.to(torch.float32)
        if self.bias32 is None:
            return torch.mm(x32, weight_t).to(self.dtype)
        return torch.addmm(self.bias32, x32, weight_t).to(self.dtype)

    def dequantize_into_scratch(self, transposed: bool = False) -> torch.Tensor:
        """The weight over the scratch buffer: ``[N, K]`` in the model's dtype, or
        (``transposed``) ``[K, N]`` in float32."""
        shape = (self.in_features, self.out_features) if transposed else self.weight_shape
        dtype = torch.float32 if transposed else self.dtype
        weight = self.scratch.borrow(shape, dtype)
        packed = self.packed
        status = cpu_library.load().pdserve_quantized_dequantize(
            packed.tiles.data_ptr(),
            packed.code,
            packed.group_size,
            int(packed.has_offsets),
            weight.data_ptr(),
            KV_DTYPE_CODES[dtype],
            int(transposed),
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("dequantizing the weight could not allocate its scratch memory")
        return weight

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"this layer takes {self.dtype} [rows, {self.in_features}], got {x.dtype} "
                f"{tuple(x.shape)}"
            )

    def extra_repr(self) -> str:
        packed = self.packed
        offsets = ", offsets" if packed.has_offsets else ""
        rows = (
            "every row count"
            if self.tiles_only or self.tile_max_rows is None
            else f"up to {self.tile_max_rows} rows, {self.blas_dtype} BLAS beyond"
        )
        sums = "integer sums" if packed.integer_sums else "float32 tiles"
        return (
            f"in={self.in_features}, out={self.out_features}, {packed.kind} in groups of "
            f"{packed.group_size}{offsets}, {sums} at {rows}"
        )
