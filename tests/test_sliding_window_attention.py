"""Every attention backend through a sliding window, against the twin in ``tests/kernel_twins.py``.

A query at position p sees positions p - window < j <= p (``transformers``' convention). The
batches come from ``test_kernels.make_batch`` (pools filled with NaN, pages scattered), and
each sequence's page-table entries for pages wholly before the window its first query row sees
are then pointed at the never-written page, as if those pages were back in the pool: a backend
that reads one, instead of skipping it, returns NaN.
"""

from __future__ import annotations

import pytest
import torch
from kernel_twins import paged_attention_twin
from test_kernels import DEVICE, INTERPRETED, TOLERANCE, Batch, make_batch

from kernels.cpu.backend import CpuAttentionBackend
from kernels.cpu.library import CpuKernelsUnavailable
from kernels.interface import FP8_DTYPE, INT8_DTYPE, AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend
from kernels.triton.backend import TritonAttentionBackend
from kernels.triton.decode_attention import decode_attention
from kernels.triton.prefill_attention import prefill_attention
from kernels.triton.tiles import PrefillTiles

# (query_lens, seq_lens): decode rows, verification runs, chunks over cached prefixes and a whole
# prompt, with contexts on and off page edges.
BATCHES = {
    "decode": ([1] * 5, [1, 16, 17, 100, 257]),
    "verify": ([4, 1, 7], [40, 30, 70]),
    "chunks": ([20, 1, 40, 33], [53, 9, 90, 100]),
    "prompt": ([150], [150]),
}
# Windows of one position, under a page, a page, and wider than some contexts.
WINDOWS = [1, 7, 16, 45]


def release_pages_before_windows(batch: Batch, window: int) -> Batch:
    """``batch`` with each page-table entry before its window's first page pointing at page 0,
    the page ``make_batch`` never writes (NaN)."""
    tables = batch.meta.page_tables.clone()
    starts = batch.meta.query_start_loc.tolist()
    page_size = batch.cache.page_size
    for seq, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        q_len = starts[seq + 1] - starts[seq]
        first_seen = max(0, seq_len - q_len - window + 1)
        tables[seq, : first_seen // page_size] = 0
    meta = AttentionMetadata(
        query_start_loc=batch.meta.query_start_loc,
        seq_lens=batch.meta.seq_lens,
        page_tables=tables,
        slot_mapping=batch.meta.slot_mapping,
        max_query_len=batch.meta.max_query_len,
        max_seq_len=batch.meta.max_seq_len,
    )
    return Batch(batch.pool, batch.cache, meta, batch.query)


def windowed_batch(
    batch_name: str, window: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> Batch:
    query_lens, seq_lens = BATCHES[batch_name]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
        kv_dtype=kv_dtype or dtype,
    )
    return release_pages_before_windows(batch, window)


def assert_matches_twin(out: torch.Tensor, batch: Batch, window: int, dtype: torch.dtype) -> None:
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_twin(batch.query, batch.cache, batch.meta, scale, window)
    assert not out.isnan().any(), "read a page before the window"
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.fixture(scope="module")
def cpu_backend() -> CpuAttentionBackend:
    try:
        return CpuAttentionBackend()
    except CpuKernelsUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("window", WINDOWS)
def test_the_torch_backend_attends_through_the_window(batch_name: str, window: int) -> None:
    batch = windowed_batch(batch_name, window, torch.float32)
    out = TorchAttentionBackend().attention(batch.query, batch.cache, batch.meta, 0.125, window)
    assert_matches_twin(out, batch, window, torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels")
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, FP8_DTYPE),
        (torch.float32, INT8_DTYPE),
    ],
    ids=["f32", "bf16", "f32-fp8", "f32-int8"],
)
def test_the_cpu_backend_attends_through_the_window(
    cpu_backend, batch_name: str, window: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """Short runs in the C kernel, long chunks (and whole prompts) in SDPA."""
    batch = windowed_batch(batch_name, window, dtype, kv_dtype)
    plan = cpu_backend.plan(batch.meta)
    out = cpu_backend.attention(batch.query, batch.cache, plan, 0.125, window)
    assert out.dtype == dtype
    assert_matches_twin(out, batch, window, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels")
@pytest.mark.parametrize("window", WINDOWS)
def test_the_deterministic_cpu_kernel_gives_a_row_the_same_bits_in_any_run(window) -> None:
    """A row's bits through a window are fixed by its position alone: attended in a chunk of
    40 rows after a prefix, or one at a time as decode steps, it is the same."""
    try:
        deterministic = CpuAttentionBackend(deterministic=True)
    except CpuKernelsUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")
    batch = windowed_batch("chunks", window, torch.float32)
    scale = 0.125
    whole = deterministic.attention(batch.query, batch.cache, batch.meta, scale, window)
    assert_matches_twin(whole, batch, window, torch.float32)
    seq, start, q_len, seq_len = 2, 21, 40, 90  # the chunk of 40 rows over 50 cached tokens
    for row in range(q_len):
        one = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len - q_len + row + 1], dtype=torch.int32),
            page_tables=batch.meta.page_tables[seq : seq + 1],
            slot_mapping=batch.meta.slot_mapping[start + row : start + row + 1],
            max_query_len=1,
            max_seq_len=seq_len - q_len + row + 1,
        )
        query = batch.query[start + row : start + row + 1]
        alone = deterministic.attention(query, batch.cache, one, scale, window)
        assert torch.equal(alone[0], whole[start + row])


# Triton runs interpreted on a CPU: float32 and fp16 only (its tl.dot is wrong on bf16).
TRITON_DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_the_triton_prefill_kernel_attends_through_the_window(
    batch_name: str, window: int, dtype: torch.dtype
) -> None:
    batch = windowed_batch(batch_name, window, dtype)
    out = prefill_attention(batch.query, batch.cache, batch.meta, 0.125, window)
    assert_matches_twin(out, batch, window, dtype)


@pytest.mark.parametrize("window", [7, 45])
@pytest.mark.parametrize("block_m, block_n", [(64, 16), (16, 64)])
def test_the_triton_prefill_kernel_takes_any_tiles_through_the_window(window, block_m, block_n):
    """Query tiles taller than key tiles (a tile's rows start their windows tiles apart) and
    the other way round (a key tile holds positions of pages before the window)."""
    batch = windowed_batch("chunks", window, torch.float32)
    tiles = PrefillTiles(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1)
    out = prefill_attention(batch.query, batch.cache, batch.meta, 0.125, window, tiles=tiles)
    assert_matches_twin(out, batch, window, torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_triton_decode_kernel_attends_through_the_window(window: int, num_splits: int):
    batch = windowed_batch("decode", window, torch.float16)
    out = decode_attention(
        batch.query, batch.cache, batch.meta, 0.125, window, num_splits=num_splits
    )
    assert_matches_twin(out, batch, window, torch.float16)


@pytest.mark.parametrize("window", [7, 45])
def test_the_deterministic_triton_path_gives_a_row_the_same_bits_in_any_run(window) -> None:
    backend = TritonAttentionBackend(deterministic=True)
    batch = windowed_batch("chunks", window, torch.float32)
    whole = backend.attention(batch.query, batch.cache, batch.meta, 0.125, window)
    seq, start, q_len, seq_len = 3, 61, 33, 100
    for row in (0, 5, 32):
        one = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([seq_len - q_len + row + 1], dtype=torch.int32, device=DEVICE),
            page_tables=batch.meta.page_tables[seq : seq + 1],
            slot_mapping=batch.meta.slot_mapping[start + row : start + row + 1],
            max_query_len=1,
            max_seq_len=seq_len - q_len + row + 1,
        )
        query = batch.query[start + row : start + row + 1]
        alone = backend.attention(query, batch.cache, one, 0.125, window)
        assert torch.equal(alone[0], whole[start + row])


@pytest.mark.parametrize("window", [0, -3, True])
def test_a_window_that_is_no_number_of_positions_is_refused(window) -> None:
    batch = windowed_batch("decode", 7, torch.float32)
    with pytest.raises(ValueError, match="sliding window"):
        TorchAttentionBackend().attention(batch.query, batch.cache, batch.meta, 0.125, window)
    with pytest.raises(ValueError, match="sliding window"):
        decode_attention(batch.query, batch.cache, batch.meta, 0.125, window)
