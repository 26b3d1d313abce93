"""CUDA graphs of the decode step (``common/engine/cuda_graphs.py``).

Without a GPU: the batch sizes captured, which steps a graph takes, and the padded static batch
a graph replays, run eagerly on the Triton kernels (interpreted) against the plain step: the
same logits for the real rows, and nothing stored for the padding rows. On CUDA: an engine that
replays graphs gives the greedy tokens of one that runs eagerly.
"""

from __future__ import annotations

import os

import pytest
import torch
from engines import build_engine
from tiny_models import assert_greedy_equal_up_to_near_ties, build_tiny_model, random_prompts

from common.engine import llm_engine
from common.engine.batch import ForwardInputs, TokenRun, flatten_runs
from common.engine.cuda_graphs import StaticDecodeBatch, capture_sizes
from common.sampling_params import SamplingParams
from kernels.lora import LoraSegments
from kernels.registry import ENV_VAR

PAGE_SIZE = 16


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(100)[-3:] == [64, 96, 100]
    assert capture_sizes(4096)[-1] == 512


def decode_inputs(seq_lens: list[int], first_page: int = 0) -> ForwardInputs:
    """A decode step: each sequence's next token, at position len - 1, on pages of its own."""
    runs, page = [], first_page
    for length in seq_lens:
        pages = -(-length // PAGE_SIZE)
        runs.append(TokenRun([7 + length], length - 1, list(range(page, page + pages)), 1))
        page += pages
    return flatten_runs(runs, PAGE_SIZE, torch.device("cpu"))


def test_which_steps_fit() -> None:
    batch = StaticDecodeBatch(8, 256, PAGE_SIZE, torch.device("cpu"))
    assert batch.fits(decode_inputs([5, 40, 256]))
    assert batch.fits(decode_inputs([3] * 8))
    assert not batch.fits(decode_inputs([3] * 9))  # more sequences than the largest graph
    chunk = flatten_runs([TokenRun([1, 2, 3], 0, [0], 1)], PAGE_SIZE, torch.device("cpu"))
    assert not batch.fits(chunk)  # a prefill chunk
    two_logits = flatten_runs(
        [TokenRun([1], 4, [0], 1), TokenRun([2], 4, [1], 0)], PAGE_SIZE, torch.device("cpu")
    )
    assert not batch.fits(two_logits)  # a row that wants no logits


def test_load_pads_the_rows_behind_the_step() -> None:
    batch = StaticDecodeBatch(8, 256, PAGE_SIZE, torch.device("cpu"))
    batch.load(decode_inputs([3] * 6), 8)  # stale rows 3..5 from an earlier, larger step
    step = decode_inputs([5, 40, 17], first_page=9)
    batch.load(step, 4)
    inputs = batch.inputs(4)
    assert inputs.input_ids.tolist() == [*step.input_ids.tolist(), 0]
    assert inputs.positions.tolist() == [4, 39, 16, 0]
    assert inputs.meta.seq_lens.tolist() == [5, 40, 17, 1]
    assert inputs.meta.slot_mapping.tolist() == [*step.meta.slot_mapping.tolist(), -1]
    assert inputs.meta.page_tables[3, 0].item() == 0
    assert inputs.meta.page_tables[:3, :3].tolist() == step.meta.page_tables.tolist()
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert inputs.meta.max_seq_len == 256


def test_load_lora_gives_each_row_its_own_segment() -> None:
    """A graph's LoRA segments: row i's own (i, i+1) under its adapter's slot, an empty one for
    the base model's rows and the padding, whatever an earlier step left there."""
    batch = StaticDecodeBatch(8, 256, PAGE_SIZE, torch.device("cpu"))
    cpu = torch.device("cpu")
    earlier = LoraSegments.of_rows([(1, 1)] * 8, cpu)
    assert earlier is not None
    batch.load_lora(earlier, 8)
    step = LoraSegments.of_rows([(1, 2), (1, 2), (1, None), (1, 0)], cpu)  # two share a segment
    assert step is not None and step.starts == [0, 3]
    batch.load_lora(step, 6)
    segments = batch.lora_segments(6)
    assert segments.start_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert segments.end_rows.tolist() == [1, 2, 2, 4, 4, 5]
    assert segments.slot_ids.tolist() == [2, 2, 0, 0, 0, 0]
    assert (segments.launch_segments, segments.launch_rows) == (6, 1)
    batch.pad(0, 8)
    assert batch.lora_segments(8).end_rows.tolist() == list(range(8))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton reads CPU tensors only in its interpreter; on CUDA the graphs themselves run",
)
def test_a_graphs_lora_segments_give_the_steps_deltas() -> None:
    """The batched LoRA kernels launched as a graph launches them (one program per row of the
    padded batch, the bounds read from the buffers) add what the step's own segments add."""
    from kernels.lora import lora_delta_reference
    from kernels.triton.lora import lora_delta

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=generator)
    a = torch.randn(3, 8, 48, generator=generator) / 7
    b = torch.randn(3, 8, 40, generator=generator)
    scales = torch.tensor([0.5, 2.0, 1.0])
    step = LoraSegments.of_rows([(1, 1), (1, None), (1, 2), (1, 2), (1, 0)], torch.device("cpu"))
    assert step is not None
    base = torch.randn(8, 40, generator=generator)
    expected = base.clone()
    lora_delta_reference(expected[:5], x, a, b, scales, step)
    batch = StaticDecodeBatch(8, 256, PAGE_SIZE, torch.device("cpu"))
    batch.load_lora(step, 8)
    got = base.clone()
    padded_x = torch.cat([x, torch.randn(3, 48, generator=generator)])
    lora_delta(got, padded_x, a, b, scales, batch.lora_segments(8))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], base[1]) and torch.equal(got[5:], base[5:])


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton reads CPU tensors only in its interpreter; on CUDA the graphs themselves run",
)
def test_padded_static_batch_gives_the_steps_logits(tmp_path, monkeypatch) -> None:
    """A decode step through the static batch, padded to a larger size, gives the logits of the
    step run as it is, and its padding rows store nothing in the pool."""
    monkeypatch.setenv(ENV_VAR, "triton")
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    engine = build_engine(folder, num_pages=32, max_model_len=256, kv_cache_dtype="fp8")
    model, pool = engine.model, engine.pool
    prompts = random_prompts(3, seed=3, min_len=10, max_len=40)
    # Fill the pool with the prompts' KV (prefill), as a decode worker's would be.
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    seq_lens = [len(p) + 1 for p in prompts]
    step = decode_inputs(seq_lens, first_page=1)

    with torch.inference_mode():
        expected = model(step.input_ids, step.positions, step.meta, step.logits_indices)
        data, scales = pool.data.clone(), pool.scales.clone()
        batch = StaticDecodeBatch(8, 256, PAGE_SIZE, torch.device("cpu"))
        batch.load(step, 8)
        padded = batch.inputs(8)
        got = model(padded.input_ids, padded.positions, padded.meta, padded.logits_indices)

    assert got.shape[0] == 8
    torch.testing.assert_close(got[:3], expected, rtol=1e-4, atol=1e-4)
    # Only the real rows' slots were written (again): the padding rows' -1 stores nothing.
    changed = (pool.data != data).flatten(1).any(1) | (pool.scales != scales).flatten(1).any(1)
    real_pages = set((step.meta.slot_mapping // PAGE_SIZE).tolist())
    assert set(changed.nonzero().flatten().tolist()) <= real_pages


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "fp8")])
def test_cuda_graphs_give_the_eager_tokens(tmp_path, monkeypatch, dtype, kv_cache_dtype) -> None:
    """The same requests through an engine that replays decode graphs and one that runs every
    step eagerly: the same greedy tokens (up to near ties: a padded batch may take other GEMM
    kernels and another split of the context, which round differently), and the graphs did
    replay. Batches of 1 to 6 decoding sequences cross several captured sizes; max_num_seqs 6
    makes the largest graph 6."""
    monkeypatch.setenv(ENV_VAR, "triton")
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    prompts = random_prompts(6, seed=11, min_len=5, max_len=60)
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0) for i in range(6)]
    results = []
    for eager in (True, False):
        engine = build_engine(
            folder,
            device="cuda",
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            num_pages=128,
            max_num_seqs=6,
            max_model_len=256,
            enforce_eager=eager,
        )
        graphs = engine.runner.graphs
        assert (graphs is None) == eager
        results.append(engine.generate(prompts, params))
        if graphs is not None:
            assert graphs.sizes == [1, 2, 4, 6]
            assert graphs.replays > 0
    # FP8 pages keep 3 bits of mantissa: where the padded batch's GEMMs round a key one bf16 step
    # apart, its page can hold a value one e4m3 step (up to 1/8) apart, and the logits move far
    # more than bf16's near ties. On an H200 two tokens 0.196 apart parted that way; a token from a
    # wrong replay lies ~2.9 below the best on this model (the median of its logits' gaps).
    tolerance = 0.5 if kv_cache_dtype == "fp8" else 0.15
    assert_greedy_equal_up_to_near_ties(folder, prompts, results[1], results[0], tolerance)


@pytest.mark.slow
@pytest.mark.gpu
def test_cuda_graphs_under_adapters_give_the_eager_tokens(tmp_path, monkeypatch) -> None:
    """Decode steps mixing two LoRA adapters and the base model replay the adapter graphs and
    give the greedy tokens of an engine that runs every step eagerly (up to near ties)."""
    from tiny_loras import save_tiny_lora

    from common.config import LoraConfig

    monkeypatch.setenv(ENV_VAR, "triton")
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    adapters = {
        name: str(save_tiny_lora(folder, tmp_path / name, seed=seed))
        for name, seed in (("one", 1), ("two", 2))
    }
    lora = LoraConfig(enable_lora=True, modules=adapters, max_loras=2, max_lora_rank=8)
    prompts = random_prompts(6, seed=12, min_len=5, max_len=60)
    names = ["one", None, "two", "one", "two", None]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    results = []
    for eager in (True, False):
        engine = build_engine(
            folder,
            device="cuda",
            num_pages=128,
            max_num_seqs=6,
            max_model_len=256,
            enforce_eager=eager,
            lora=lora,
        )
        results.append(engine.generate(prompts, params, lora_names=names))
        graphs = engine.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.adapters and graphs.replays > 0
    assert_greedy_equal_up_to_near_ties(folder, prompts, results[1], results[0], 0.15)


def test_a_failed_capture_leaves_the_engine_eager(tmp_path, monkeypatch, caplog) -> None:
    """A model or kernel that cannot be recorded costs the graphs, not the engine: it logs
    why, and decodes eagerly."""

    class UncapturableGraphs:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def capture(self) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(llm_engine, "DecodeGraphs", UncapturableGraphs)
    monkeypatch.setattr(llm_engine.LLMEngine, "_cuda_graph_sizes", lambda self, role: [1, 2])
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    engine = build_engine(folder, num_pages=32, max_model_len=128)
    assert engine.runner.graphs is None
    assert "CUDA graph capture failed, decoding eagerly" in caplog.text
    tokens = engine.generate(random_prompts(2, seed=5), SamplingParams(max_tokens=3))
    assert [len(run) for run in tokens] == [3, 3]
