"""Batched LoRA's C kernel (``kernels/cpu/lora_delta.c``) against its torch twin
(``kernels/lora.py``'s ``lora_delta_reference``), a row's bits independent of the rows beside it,
and the C decoder layer under adapters against the module path, bit for bit."""

from __future__ import annotations

import pytest
import torch
from engines import build_engine
from tiny_loras import save_tiny_lora
from tiny_models import build_tiny_model, random_prompts

from common.config import LoraConfig
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library
from kernels.cpu.layer import FusedDecoderLayer
from kernels.cpu.linear import TILES_ONLY
from kernels.cpu.lora_delta import MAX_RANK_ROWS, lora_delta_bf16, lora_weights, takes_rows
from kernels.lora import LoraSegments, lora_delta_reference

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels"),
    pytest.mark.skipif(not cpu_library.available(), reason="no C compiler for the CPU kernels"),
]
CPU = torch.device("cpu")


def stacked_slots(slots: int, max_rank: int, in_features: int, out_sizes: list[int], seed: int):
    """``LoraProjection``'s layout: each target's A on its rank rows, its B (transposed) on the
    same rows and its own output columns, zeros elsewhere; a smaller rank in slot 1."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(out_sizes) * max_rank
    a = torch.zeros(slots, rows, in_features)
    b = torch.zeros(slots, rows, sum(out_sizes))
    column = 0
    for target, size in enumerate(out_sizes):
        first = target * max_rank
        for slot in range(slots):
            rank = max_rank if slot != 1 else max_rank // 2
            a[slot, first : first + rank] = torch.randn(rank, in_features, generator=generator)
            b[slot, first : first + rank, column : column + size] = torch.randn(
                rank, size, generator=generator
            )
        column += size
    a /= in_features**0.5
    scales = torch.tensor([0.5, 2.0, 1.25][:slots])
    return a.bfloat16(), b.bfloat16(), scales


@pytest.mark.parametrize(
    "rows, in_features, out_sizes, max_rank",
    [
        ([(1, 0), (1, None), (1, 2), (1, 1)], 64, [64, 16, 16], 8),  # decode rows, q/k/v
        ([(37, 1), (5, None), (20, 0), (3, 1)], 72, [200], 12),  # chunks, K not of 16 lanes
        ([(6, 2)], 40, [300, 300], 5),  # gate/up: chunks past 32 columns, an odd rank
        ([(300, 0), (9, None), (100, 1)], 256, [256, 64, 64], 16),  # shared between threads
    ],
)
def test_the_c_kernel_equals_the_twin(rows, in_features, out_sizes, max_rank):
    a, b, scales = stacked_slots(3, max_rank, in_features, out_sizes, seed=0)
    weights = lora_weights(a, b, scales, max_rank, out_sizes)
    assert weights is not None
    num_rows = sum(count for count, _ in rows)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    base = torch.randn(num_rows, sum(out_sizes), generator=generator).bfloat16()
    segments = LoraSegments.of_rows(rows, CPU)
    assert segments is not None
    expected, got = base.clone(), base.clone()
    # The twin over the slots' very values, in float32: what the kernel computes.
    lora_delta_reference(expected, x, a.float(), b.float(), scales, segments)
    lora_delta_bf16(got, x, weights, segments)
    # Both sum in float32 and round once to bf16 before the add; their sums' orders differ, so
    # a value near a rounding boundary may land one bf16 step apart.
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)
    assert (got != expected).float().mean() < 0.05
    base_rows = [i for i, slot in enumerate(s for n, s in rows for s in [s] * n) if slot is None]
    assert torch.equal(got[base_rows], base[base_rows])
    changed = [i for i in range(num_rows) if i not in base_rows]
    assert not torch.equal(got[changed], base[changed])


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    out_sizes = [96, 32, 32]
    a, b, scales = stacked_slots(3, 8, 80, out_sizes, seed=2)
    weights = lora_weights(a, b, scales, 8, out_sizes)
    assert weights is not None
    generator = torch.Generator().manual_seed(3)
    # Enough rows that the call shares them between threads where it has two.
    x = torch.randn(1001, 80, generator=generator).bfloat16()
    base = torch.randn(1001, 160, generator=generator).bfloat16()
    together = base.clone()
    lora_delta_bf16(together, x, weights, LoraSegments.of_rows([(5, 0), (996, 2)], CPU))
    for row, slot in [(0, 0), (4, 0), (5, 2), (10, 2), (1000, 2)]:
        alone = base[row : row + 1].clone()
        lora_delta_bf16(alone, x[row : row + 1], weights, LoraSegments.of_rows([(1, slot)], CPU))
        assert torch.equal(alone, together[row : row + 1])


def test_slots_the_kernel_does_not_take_are_left_to_torch():
    a, b, scales = stacked_slots(2, 8, 64, [64], seed=4)
    assert lora_weights(a.float(), b.float(), scales, 8, [64]) is None  # not bf16
    assert lora_weights(a, b, scales, 4, [64]) is None  # rank rows that do not add up
    wide = MAX_RANK_ROWS + 1
    too_wide = torch.zeros(1, wide, 8, dtype=torch.bfloat16)
    assert lora_weights(too_wide, too_wide, scales, wide, [8]) is None
    rows = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert takes_rows(rows, rows) and not takes_rows(rows.float(), rows)
    assert not takes_rows(rows.t(), rows.t())


def test_fused_layers_under_adapters_give_the_module_paths_bits(tmp_path, monkeypatch):
    """Decode steps of a batch mixing the base and two adapters run each layer as one C call
    (the adapters' deltas inside it) with the module path's token ids and logprobs."""
    monkeypatch.setattr("kernels.layer_kernels.choose_gemm_plan", lambda linears: TILES_ONLY)
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    adapters = {
        name: str(save_tiny_lora(folder, tmp_path / name, seed=seed))
        for name, seed in (("one", 1), ("two", 2))
    }
    engine = build_engine(
        folder,
        dtype="bfloat16",
        prefix_caching=False,
        lora=LoraConfig(enable_lora=True, modules=adapters, max_loras=2, max_lora_rank=8),
    )
    assert engine.model.fused_layers is not None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    first, second = random_prompts(2, seed=7)
    prompts = [first] * 3 + [second] * 3
    names = [None, "one", "two"] * 2

    def serve() -> list[list[tuple[int, float]]]:
        pairs = zip(prompts, names, strict=True)
        ids = [engine.add_request(prompt, params, lora_name=name) for prompt, name in pairs]
        out: dict[str, list[tuple[int, float]]] = {i: [] for i in ids}
        while engine.has_unfinished:
            for output in engine.step():
                out[output.request_id] += [(s.token_id, s.logprob) for s in output.new_samples]
        return [out[i] for i in ids]

    calls = []
    real_call = FusedDecoderLayer.__call__
    monkeypatch.setattr(
        FusedDecoderLayer,
        "__call__",
        lambda self, *a: calls.append(a[-1] is not None) or real_call(self, *a),
    )
    fused = serve()
    assert any(calls)  # layers ran as C calls with adapter rows in them
    engine.model.fused_layers = None
    assert serve() == fused
    # The adapters change the answers: neither path skipped the deltas.
    assert fused[0] != fused[1] and fused[0] != fused[2] and fused[1] != fused[2]
