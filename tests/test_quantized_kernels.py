"""The quantized tile GEMMs against their torch twin, ``F.linear(x.float(), weight.dequantize(),
bias)``: the float32 tiles (``kernels/cpu/quantized_tiles.c``, every kind of code) and, where
the processor has AVX512_VNNI, the integer sums (``kernels/cpu/quantized_quads.c``, int8 and
4-bit codes).

Scales and offsets are bf16 values, as checkpoints store them, so the twin's dequantized weight
is exact; the float32 tiles differ from it only in summation order (they sum code times input
per group, then scale the group's sum) and, for bf16 outputs, in one rounding; the integer sums
also round each input row to integers at 2^-22 (float32 rows) or 2^-14 (bf16 rows) of its
largest magnitude.
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
from kernels.cpu.quantized_linear import (
    QUAD_CODES,
    TILE_MAX_ROWS,
    CpuQuantizedLinear,
    integer_sums_fit,
)
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


FLOAT_TILES = "float32-tiles"
INTEGER_SUMS = "integer-sums"


def integer_sums_here() -> bool:
    return bool(cpu_library.load().pdserve_quantized_quads_available())


def kernel_cases() -> list:
    """(kind, kernel) pairs: every kind in the float32 tiles, int8 and 4-bit codes also in the
    integer sums (skipped where the processor has no AVX512_VNNI)."""
    cases = [pytest.param(kind, FLOAT_TILES, id=f"{kind}-{FLOAT_TILES}") for kind in CODE_KINDS]
    for kind in QUAD_CODES:
        cases.append(pytest.param(kind, INTEGER_SUMS, id=f"{kind}-{INTEGER_SUMS}"))
    return cases


def layer_for(weight, bias, dtype, kernel: str, **options) -> CpuQuantizedLinear:
    """The layer over ``weight`` in ``kernel``; the test skips where that kernel cannot run."""
    if kernel == INTEGER_SUMS and not (integer_sums_here() and integer_sums_fit(weight)):
        pytest.skip("no AVX512_VNNI here: no integer sums")
    layer = CpuQuantizedLinear(weight, bias, dtype, integer_sums=kernel == INTEGER_SUMS, **options)
    assert layer.packed.integer_sums == (kernel == INTEGER_SUMS)
    return layer


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
@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_tiles_match_the_dequantized_twin(kind, kernel, offsets, grouping, dtype) -> None:
    """Every row count (each register block, the decoded chunk past a few rows), bias or none,
    one thread or two; and a row's outputs the same bits whatever the rows beside it."""
    in_features, group_size = grouping
    weight = random_weight(kind, in_features, group_size, offsets, seed=in_features + group_size)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=generator).to(dtype)
    bias = torch.randn(OUT_FEATURES, generator=generator).to(dtype)
    for with_bias in (False, True):
        layer = layer_for(weight, bias if with_bias else None, dtype, kernel, tiles_only=True)
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
@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_tiles_side_by_side_keep_each_rows_bits(kind, kernel, offsets) -> None:
    """A few rows run over several tiles at once, the tiles left over at the end one by one:
    ten tiles (the last one short) give every row count from 1 to 9 whole blocks and leftovers,
    and each row's outputs must be the bits it gets beside 8 others (the decoded chunk's path)
    and close to the twin."""
    out_features = 9 * 32 + 13
    weight = random_weight(kind, 320, 32, offsets, seed=17, out_features=out_features)
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer = layer_for(weight, None, torch.bfloat16, kernel, tiles_only=True)
    with torch_threads(1):
        every_row = layer(x)
    expected = twin(x, weight, None).bfloat16()
    torch.testing.assert_close(every_row.float(), expected.float(), **TOLERANCE[torch.bfloat16])
    for rows, threads in itertools.product(range(1, 9), (1, 2)):
        with torch_threads(threads):
            assert torch.equal(layer(x[:rows]), every_row[:rows]), (rows, threads)


@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_exact_sums_agree_to_the_bit(kind, kernel) -> None:
    """Integer inputs, power-of-two scales and codes on a coarse grid: every product and sum is
    exact in float32, in any order (and the inputs in the integer sums' limbs), so the kernel
    must equal the twin bit for bit (a code read from the wrong column or group would not)."""
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
        out = layer_for(weight, bias, torch.float32, kernel, tiles_only=True)(x[:rows])
        assert torch.equal(out, twin(x[:rows], weight, bias))


@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_odd_input_width(kind, kernel) -> None:
    """An odd K: 4-bit codes pad their last byte, the integer sums their last quad; the kernel
    reads no input past K."""
    weight = random_weight(kind, 75, 16, True, seed=11, out_features=40)
    x = torch.randn(5, 75)
    out = layer_for(weight, None, torch.float32, kernel, tiles_only=True)(x)
    torch.testing.assert_close(out, twin(x, weight, None), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_many_rows_dequantize_for_torch_gemm_unless_steps_are_short(kind, kernel, dtype) -> None:
    """Past TILE_MAX_ROWS rows the float32 tiles dequantize and run torch's GEMM (close to the
    twin); a step of short runs, and a tiles-only layer, keep the tiles' bits at any row count.
    The integer sums outrun float32 BLAS and keep their tiles (where the BLAS is bf16, on AMX,
    they dequantize as the float32 tiles do); both dequantize alike when asked."""
    weight = random_weight(kind, 576, 128, True, seed=5)
    x = torch.randn(max(TILE_MAX_ROWS.values()) + 40, 576).to(dtype)
    bias = torch.randn(OUT_FEATURES).to(dtype)
    step = StepShape()
    layer = layer_for(weight, bias, dtype, kernel, step=step)
    if kernel == INTEGER_SUMS:
        assert layer.tile_max_rows == (
            TILE_MAX_ROWS[BF16_BLAS] if layer.blas_dtype == BF16_BLAS else None
        )
    tiles = layer_for(weight, bias, dtype, kernel, tiles_only=True)(x)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", list(QUAD_CODES))
def test_integer_sums_round_each_row_at_its_own_scale(kind, dtype) -> None:
    """Rows of every magnitude, one spanning 2^40 from its largest value to its smallest: each
    within the bound its rounding to integers allows (half a unit of 2^-22, float32 rows, or
    2^-14, bf16 rows, of its largest magnitude, times the sum of a column's weights' magnitudes,
    beside float32 summation), and the same bits alone as beside the others."""
    weight = random_weight(kind, 320, 64, True, seed=23)
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 320, generator=generator)
    rows[0] *= 1e-30
    rows[1] *= 1e30
    rows[2] *= torch.exp2(-torch.arange(320) / 8.0)  # 2^0 down to 2^-40
    rows[3] = 0.0
    x = rows.to(dtype)
    layer = layer_for(weight, None, dtype, INTEGER_SUMS, tiles_only=True)
    out = layer(x)
    expected = twin(x, weight, None)
    row_bits = 22 if dtype == torch.float32 else 14
    largest = x.float().abs().amax(dim=1, keepdim=True)
    bound = largest * 2.0**-row_bits * weight.dequantize().abs().sum(dim=1)
    output_rounding = expected.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-20)
    assert torch.all((out.float() - expected).abs() <= bound + output_rounding + 1e-37)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    for row in range(len(x)):
        assert torch.equal(layer(x[row : row + 1]), out[row : row + 1])


@pytest.mark.parametrize("kind", list(QUAD_CODES))
def test_integer_sums_give_a_row_that_is_not_finite_nans(kind) -> None:
    weight = random_weight(kind, 96, 32, False, seed=29)
    x = torch.randn(4, 96).bfloat16()
    x[1, 7] = float("inf")
    x[2, 50] = float("nan")
    layer = layer_for(weight, None, torch.bfloat16, INTEGER_SUMS, tiles_only=True)
    out = layer(x)
    assert torch.isnan(out[1:3]).all()
    assert torch.isfinite(out[[0, 3]]).all()
    assert torch.equal(out[[0, 3]], layer(x[[0, 3]]))


@pytest.mark.parametrize("kind", list(QUAD_CODES))
def test_integer_sums_run_long_batches_in_row_chunks(kind) -> None:
    """Past 256 rows a call runs its rows in chunks: every row the bits it has alone, at one
    thread or two, and the extreme codes (int8's -128 against inputs at a row's largest) sum
    without overflow."""
    weight = random_weight(kind, 576, 576, False, seed=31)
    if kind == INT8:
        weight.codes[:8] = -128
    x = torch.randn(300, 576).bfloat16()
    x[:, :8] = x.abs().amax(dim=1, keepdim=True).bfloat16()
    layer = layer_for(weight, None, torch.bfloat16, INTEGER_SUMS, tiles_only=True)
    with torch_threads(2):
        out = layer(x)
    torch.testing.assert_close(
        out.float(), twin(x, weight, None).bfloat16().float(), **TOLERANCE[torch.bfloat16]
    )
    with torch_threads(1):
        for rows in (slice(0, 1), slice(255, 258), slice(299, 300)):
            assert torch.equal(layer(x[rows]), out[rows])


def test_groups_off_the_quads_take_the_float_tiles() -> None:
    """A group that does not start every fourth input (6 here) cannot be cut into quads: such a
    weight is packed for the float32 tiles, and still matches its twin."""
    weight = random_weight(INT8, 96, 6, False, seed=37)
    assert not integer_sums_fit(weight)
    layer = CpuQuantizedLinear(weight, None, torch.float32, tiles_only=True)
    assert not layer.packed.integer_sums
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), twin(x, weight, None), **TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match="cannot be summed in integers"):
        CpuQuantizedLinear(weight, None, torch.float32, integer_sums=True)


@pytest.mark.parametrize(("kind", "kernel"), kernel_cases())
def test_dequantized_weight_for_the_float32_blas(kind, kernel) -> None:
    """The [K, N] float32 weight the BLAS reads, whole tiles of it written past the caches
    (aligned rows: N a multiple of 16), is the weight's own dequantization."""
    weight = random_weight(kind, 320, 64, True, seed=41, out_features=96)
    layer = layer_for(weight, None, torch.float32, kernel)
    transposed = layer.dequantize_into_scratch(transposed=True)
    assert transposed.data_ptr() % 64 == 0
    torch.testing.assert_close(transposed, weight.dequantize().t(), atol=0, rtol=0)
