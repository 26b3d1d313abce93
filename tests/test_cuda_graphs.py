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


def test_a_failed_capture_leaves_the_engine_eager(tmp_path, monkeypatch, caplog) -> None:
    """A model or kernel that cannot be recorded costs the graphs, not the engine: it logs
    why, and decodes eagerly."""

    class UncapturableGraphs:
        def __init__(self, *args) -> None:
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
