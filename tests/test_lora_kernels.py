"""The batched LoRA kernels (``kernels/triton/lora.py``) against their torch twin
(``kernels/lora.py``'s ``lora_delta_reference``): in Triton's interpreter on a CPU (float32 and
fp16, whose ``tl.dot`` the interpreter computes right), compiled where a GPU is."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import LoraSegments, lora_delta_dense, lora_delta_reference
from kernels.triton.lora import lora_delta

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}


def test_segments_group_neighbouring_rows_of_one_adapter_and_skip_the_base():
    rows = [(3, 0), (2, 0), (4, None), (1, 2), (0, 1), (5, 0)]
    segments = LoraSegments.of_rows(rows, torch.device("cpu"))
    assert segments is not None
    assert (segments.starts, segments.ends, segments.slots) == ([0, 9, 10], [5, 10, 15], [0, 2, 0])
    assert segments.slot_ids.tolist() == [0, 2, 0] and segments.max_rows == 5
    assert LoraSegments.of_rows([(4, None), (1, None)], torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "rows, in_features, out_features, rank",
    [
        ([(1, 0), (1, None), (1, 2), (1, 1)], 64, 96, 8),  # decode rows, three adapters
        ([(37, 1), (5, None), (20, 0), (3, 1)], 80, 200, 24),  # prefill chunks, odd sizes
    ],
)
def test_shrink_and_expand_equal_the_twin(rows, in_features, out_features, rank, dtype):
    generator = torch.Generator().manual_seed(0)
    slots = 3
    num_rows = sum(count for count, _ in rows)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    x, a, b = (
        draw(num_rows, in_features),
        draw(slots, rank, in_features),
        draw(slots, rank, out_features),
    )
    scales = torch.tensor([0.5, 2.0, 0.25], device=DEVICE)
    base = draw(num_rows, out_features)
    segments = LoraSegments.of_rows(rows, DEVICE)
    expected, got = base.clone(), base.clone()
    lora_delta_reference(expected, x, a, b, scales, segments)
    lora_delta(got, x, a, b, scales, segments)
    tolerance = TOLERANCE[dtype] * max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=TOLERANCE[dtype])
    # The base model's rows are left as they were, bit for bit.
    base_rows = [
        i for i, row in enumerate(r for count, slot in rows for r in [slot] * count) if row is None
    ]
    assert torch.equal(got[base_rows], base[base_rows])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_cpus_dense_sum_equals_the_twin_and_leaves_base_rows_alone(out_dtype):
    """Every row against every slot, weighed by its own slot's scale: the twin's delta."""
    generator = torch.Generator().manual_seed(1)
    rows = [(3, 1), (2, None), (1, 0), (4, 3), (1, 1)]
    segments = LoraSegments.of_rows(rows, torch.device("cpu"))
    x = torch.randn(11, 40, generator=generator).to(out_dtype)
    a, b = torch.randn(4, 12, 40, generator=generator), torch.randn(4, 12, 56, generator=generator)
    scales = torch.tensor([0.5, 2.0, 1.0, 0.125])
    base = torch.randn(11, 56, generator=generator).to(out_dtype)
    expected, got = base.clone(), base.clone()
    lora_delta_reference(expected, x, a, b, scales, segments)
    lora_delta_dense(got, x, a, b, scales, segments)
    tolerance = 1e-5 if out_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * 8, rtol=tolerance)
    assert torch.equal(got[3:5], base[3:5])  # the base model's rows


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.zeros(2, 16, device=DEVICE)
    a, b = torch.zeros(1, 4, 16, device=DEVICE), torch.zeros(1, 4, 8, device=DEVICE)
    segments = LoraSegments.of_rows([(2, 0)], DEVICE)
    out = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lora_delta(out, x, a, b, torch.ones(1, dtype=torch.float64, device=DEVICE), segments)
    with pytest.raises(ValueError, match="do not fit"):
        lora_delta(
            torch.zeros(2, 9, device=DEVICE), x, a, b, torch.ones(1, device=DEVICE), segments
        )
    with pytest.raises(ValueError, match="one of"):
        lora_delta(out, x.double(), a, b, torch.ones(1, device=DEVICE), segments)
