"""The quantized tile GEMM (``kernels/cpu/quantized_tiles.c``) against its torch twin,
``F.linear(x.float(), weight.dequantize(), bias)``.

Scales and offsets are bf16 values, as checkpoints store them, so the twin's dequantized weight
is exact; the kernel differs from it only in summation order (it sums code times input per
group, then scales the group's sum) and, for bf16 outputs, in one rounding.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import library as cpu_library
from kernels.cpu.library import CpuKernelsUnavailable
from kernels.cpu.linear import BF16_BLAS, StepShape
from kernels.cpu.quantized_linear import TILE_MAX_ROWS, CpuQuantizedLinear
from kernels.quantized import (
    CODE_KINDS,
    DYNAMIC_PER_TOKEN,
    FP8_E4M3,
    INT8,
    UINT4,
    ActivationQuantization,
    QuantizedWeight,
)
from kernels.sizes import ceil_div

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels")

ROW_COUNTS = (1, 2, 3, 7, 8, 33, 512)
# (in_features, group_size): whole groups of each size, and a short last group (576 = 4.5 x 128).
GROUPINGS = [(256, 16), (256, 32), (320, 64), (384, 128), (576, 128)]
# Not a multiple of the tiles' 32 columns.
OUT_FEATURES = 70
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}
# Past TILE_MAX_ROWS a bf16 layer on AMX multiplies its weight rounded to bf16 (oneDNN).
DEQUANTIZED_BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    try:
        cpu_library.load()
    except CpuKernelsUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")


@contextlib.contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def random_codes(kind: str, rows: int, in_features: int, generator: torch.Generator):
    if kind == INT8:
        return torch.randint(-128, 128, (rows, in_features), generator=generator).to(torch.int8)
    if kind == UINT4:
        width = ceil_div(in_features, 2)
        return torch.randint(0, 256, (rows, width), generator=generator).to(torch.uint8)
    values = torch.randn(rows, in_features, generator=generator) * 64
    return values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def random_weight(
    kind: str,
    in_features: int,
    group_size: int,
    offsets: bool,
    seed: int,
    out_features: int = OUT_FEATURES,
) -> QuantizedWeight:
    """Codes of every value, bf16 scales (and offsets) that give weights of about 0.05."""
    generator = torch.Generator().manual_seed(seed)
    groups = (out_features, ceil_div(in_features, group_size))
    code_size = {INT8: 64.0, UINT4: 8.0, FP8_E4M3: 64.0}[kind]
    scales = (torch.rand(groups, generator=generator) + 0.5) * 0.05 / code_size
    shift = torch.rand(groups, generator=generator) * 0.05 if offsets else None
    return QuantizedWeight(
        kind=kind,
        codes=random_codes(kind, out_features, in_features, generator),
        scales=scales.bfloat16().float(),
        offsets=None if shift is None else shift.bfloat16().float(),
        group_size=group_size,
        in_features=in_features,
    )


def twin(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("grouping", GROUPINGS, ids=[f"k{k}g{g}" for k, g in GROUPINGS])
@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
@pytest.mark.parametrize("kind", CODE_KINDS)
def test_tiles_match_the_dequantized_twin(kind, offsets, grouping, dtype) -> None:
    """Every row count (each register block, the decoded chunk past a few rows), bias or none,
    one thread or two; and a row's outputs the same bits whatever the rows beside it."""
    in_features, group_size = grouping
    weight = random_weight(kind, in_features, group_size, offsets, seed=in_features + group_size)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=generator).to(dtype)
    bias = torch.randn(OUT_FEATURES, generator=generator).to(dtype)
    for with_bias in (False, True):
        layer = CpuQuantizedLinear(weight, bias if with_bias else None, dtype, tiles_only=True)
        expected = twin(x, weight, bias if with_bias else None)
        if dtype == torch.bfloat16:
            expected = expected.bfloat16()
        with torch_threads(2):
            every_row = layer(x)
        assert every_row.dtype == dtype and every_row.shape == (len(x), OUT_FEATURES)
        torch.testing.assert_close(every_row.float(), expected.float(), **TOLERANCE[dtype])
        for rows, threads in itertools.product(ROW_COUNTS, (1, 2)):
            with torch_threads(threads):
                out = layer(x[:rows])
            assert torch.equal(out, every_row[:rows]), (rows, threads)
        with torch_threads(1):
            assert torch.equal(layer(x[33:34]), every_row[33:34])


@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
@pytest.mark.parametrize("kind", CODE_KINDS)
def test_tiles_side_by_side_keep_each_rows_bits(kind, offsets) -> None:
    """A few rows run over several tiles at once, the tiles left over at the end one by one:
    ten tiles (the last one short) give every row count from 1 to 9 whole blocks and leftovers,
    and each row's outputs must be the bits it gets beside 8 others (the decoded chunk's path)
    and close to the twin."""
    out_features = 9 * 32 + 13
    weight = random_weight(kind, 320, 32, offsets, seed=17, out_features=out_features)
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer = CpuQuantizedLinear(weight, None, torch.bfloat16, tiles_only=True)
    with torch_threads(1):
        every_row = layer(x)
    expected = twin(x, weight, None).bfloat16()
    torch.testing.assert_close(every_row.float(), expected.float(), **TOLERANCE[torch.bfloat16])
    for rows, threads in itertools.product(range(1, 9), (1, 2)):
        with torch_threads(threads):
            assert torch.equal(layer(x[:rows]), every_row[:rows]), (rows, threads)


@pytest.mark.parametrize("kind", CODE_KINDS)
def test_exact_sums_agree_to_the_bit(kind) -> None:
    """Integer inputs, power-of-two scales and codes on a coarse grid: every product and sum is
    exact in float32, in any order, so the kernel must equal the twin bit for bit (a code read
    from the wrong column or group would not)."""
    generator = torch.Generator().manual_seed(3)
    in_features, group_size, out_features = 96, 16, 45
    groups = (out_features, in_features // group_size)
    if kind == FP8_E4M3:
        values = torch.randint(-63, 64, (out_features, in_features), generator=generator) / 4
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = random_codes(kind, out_features, in_features, generator)
    exponents = torch.randint(-6, 0, groups, generator=generator).float()
    offsets = torch.randint(-8, 8, groups, generator=generator) / 8.0
    weight = QuantizedWeight(kind, codes, torch.exp2(exponents), offsets, group_size, in_features)
    x = torch.randint(-4, 5, (9, in_features), generator=generator).float()
    bias = torch.randint(-4, 5, (out_features,), generator=generator).float()
    for rows in (1, 2, 9):
        out = CpuQuantizedLinear(weight, bias, torch.float32, tiles_only=True)(x[:rows])
        assert torch.equal(out, twin(x[:rows], weight, bias))


@pytest.mark.parametrize("kind", CODE_KINDS)
def test_odd_input_width(kind) -> None:
    """An odd K: 4-bit codes pad their last byte; the kernel reads no input past K."""
    weight = random_weight(kind, 75, 16, True, seed=11, out_features=40)
    x = torch.randn(5, 75)
    out = CpuQuantizedLinear(weight, None, torch.float32, tiles_only=True)(x)
    torch.testing.assert_close(out, twin(x, weight, None), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", CODE_KINDS)
def test_many_rows_dequantize_for_torch_gemm_unless_steps_are_short(kind, dtype) -> None:
    """Past TILE_MAX_ROWS rows the layer dequantizes and runs torch's GEMM (close to the twin);
    a step of short runs, and a tiles-only layer, keep the tiles' bits at any row count."""
    weight = random_weight(kind, 576, 128, True, seed=5)
    x = torch.randn(max(TILE_MAX_ROWS.values()) + 40, 576).to(dtype)
    bias = torch.randn(OUT_FEATURES).to(dtype)
    step = StepShape()
    layer = CpuQuantizedLinear(weight, bias, dtype, step)
    tiles = CpuQuantizedLinear(weight, bias, dtype, tiles_only=True)(x)
    blas = layer(x)
    expected = twin(x, weight, bias)
    tolerance = DEQUANTIZED_BF16_TOLERANCE if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(blas.float(), expected, **tolerance)
    dequantized = layer.dequantize_into_scratch()
    torch.testing.assert_close(dequantized, weight.dequantize().to(dtype), atol=0, rtol=0)
    transposed = layer.dequantize_into_scratch(transposed=True)
    torch.testing.assert_close(transposed, weight.dequantize().t(), atol=0, rtol=0)
    if dtype == torch.bfloat16:
        layer.blas_dtype = BF16_BLAS  # what a processor with AMX runs
        bf16_blas = layer.forward_dequantized(x)
        torch.testing.assert_close(bf16_blas.float(), expected, **DEQUANTIZED_BF16_TOLERANCE)
    step.short_runs_only = True
    assert torch.equal(layer(x), tiles)


def test_activation_rounding_comes_first() -> None:
    weight = random_weight(INT8, 256, 32, False, seed=2)
    activations = ActivationQuantization(INT8, DYNAMIC_PER_TOKEN)
    x = torch.randn(4, 256)
    layer = CpuQuantizedLinear(weight, None, torch.float32, activations=activations)
    expected = twin(activations.apply(x), weight, None)
    torch.testing.assert_close(layer(x), expected, **TOLERANCE[torch.float32])


def test_refuses_what_it_cannot_run() -> None:
    weight = random_weight(UINT4, 96, 32, False, seed=1)
    with pytest.raises(ValueError, match="float16"):
        CpuQuantizedLinear(weight, None, torch.float16)
    layer = CpuQuantizedLinear(weight, None, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        layer(torch.randn(2, 96))
    odd_groups = QuantizedWeight(
        UINT4, weight.codes, weight.scales[:, :1].repeat(1, 4), None, 25, 96
    )
    with pytest.raises(ValueError, match="split a pair"):
        CpuQuantizedLinear(odd_groups, None, torch.float32)
