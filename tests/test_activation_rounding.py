"""The C rounding of W8A8 inputs (``kernels/cpu/activation_rounding.py``) against
``ActivationQuantization.apply``: the same bits for every strategy, code kind and dtype, over
rows that hold ties, zeros, huge and tiny values."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import library as cpu_library
from kernels.cpu.activation_rounding import activation_rounding, round_activations
from kernels.quantized import (
    DYNAMIC_PER_TENSOR,
    DYNAMIC_PER_TOKEN,
    DYNAMIC_PER_TOKEN_GROUP,
    FP8_E4M3,
    FP8_E4M3_MAX,
    INT8,
    INT8_SCALE_RANGE,
    STATIC,
    ActivationQuantization,
)

pytestmark = pytest.mark.skipif(
    not cpu_library.available(), reason="no C compiler for the CPU kernels"
)

WIDTH = 200  # not a multiple of the groups below: the last group is short
STRATEGIES = [
    (DYNAMIC_PER_TOKEN, None, None),
    (DYNAMIC_PER_TOKEN_GROUP, 64, None),
    (DYNAMIC_PER_TOKEN_GROUP, 7, None),
    (DYNAMIC_PER_TENSOR, None, None),
    (STATIC, None, 0.0123),
    (STATIC, None, 1e-30),  # most values clamp to the code range's ends
]


def hard_rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of random values of every magnitude, and rows built to land on ties: a row whose
    largest magnitude is a round multiple of the code range puts many values at exact halves
    between codes (FP8 normals and subnormals, int8 halves)."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(6, WIDTH, generator=generator)
    exponents = torch.randint(-40, 40, (6, WIDTH), generator=generator).float()
    wide = normal * torch.pow(2.0, exponents)
    wide[0, ::9] = 0.0
    wide[1] = 0.0  # an all-zero row stays zero
    wide[2, :3] = torch.tensor([3e38, -3e38, 1e-38])  # huge and tiny in one row
    wide[3] = wide[3] * 1e-38  # subnormal-sized throughout
    ties = []
    for limit in (FP8_E4M3_MAX, INT8_SCALE_RANGE):
        # Scale 1 or 2: halves, and FP8's midpoints, of every binade.
        for scale in (1.0, 2.0):
            row = torch.randint(-2 * int(limit), 2 * int(limit) + 1, (WIDTH,), generator=generator)
            row = row.float() / 2 * scale
            row[0] = limit * scale
            midpoints = torch.tensor([0.5, 1.5, 2.5, 1.0625, 9.0, 17.0, 0.001953125 * 1.5])
            row[1 : 1 + len(midpoints)] = midpoints * scale
            row[10] = -limit * scale  # rounds to the most negative code
            ties.append(row)
    rows = torch.cat([wide, torch.stack(ties)])
    # bf16 rows are rounded first: their values are what the kernel reads.
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", [FP8_E4M3, INT8])
@pytest.mark.parametrize(
    "strategy, group_size, static_scale",
    STRATEGIES,
    ids=[f"{s}-{g}-{c}" for s, g, c in STRATEGIES],
)
def test_rounds_to_the_same_bits_as_the_torch_twin(
    dtype, kind, strategy, group_size, static_scale
) -> None:
    activations = ActivationQuantization(kind, strategy, static_scale, group_size)
    rounding = activation_rounding(activations)
    for seed in range(4):
        x = hard_rows(dtype, seed)
        expected = activations.apply(x)
        got = round_activations(rounding, x)
        assert torch.equal(got.view(torch.int8), expected.view(torch.int8)), (seed, strategy)
        # Rows one at a time agree too, except per tensor, whose scale spans the rows.
        if strategy != DYNAMIC_PER_TENSOR:
            row = round_activations(rounding, x[4:5])
            assert torch.equal(row.view(torch.int8), expected[4:5].view(torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounds_in_place_and_over_strided_rows(dtype) -> None:
    activations = ActivationQuantization(FP8_E4M3, DYNAMIC_PER_TOKEN)
    rounding = activation_rounding(activations)
    wide = hard_rows(dtype, seed=9)
    x = wide[:, 8:136]  # rows a stride apart that is not their width
    expected = activations.apply(x)
    assert torch.equal(round_activations(rounding, x).view(torch.int8), expected.view(torch.int8))
    round_activations(rounding, x, out=x)
    assert torch.equal(x.view(torch.int8), expected.view(torch.int8))


def test_no_rounding_copies() -> None:
    x = hard_rows(torch.bfloat16, seed=1)
    assert torch.equal(round_activations(activation_rounding(None), x), x)


def test_refuses_what_it_cannot_round() -> None:
    rounding = activation_rounding(ActivationQuantization(INT8, DYNAMIC_PER_TOKEN))
    with pytest.raises(ValueError):
        round_activations(rounding, torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError):
        round_activations(rounding, torch.zeros(8, 2).t())
