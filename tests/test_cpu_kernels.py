"""The C kernels of the CPU path (``kernels/cpu/``) against their torch references.

The attention batches come from ``test_kernels.make_batch``: pools filled with NaN, pages
scattered, page tables padded with a page never written, so a kernel that reads a slot past a
sequence's end returns NaN and fails. Tolerances: float32 runs differ from the reference only in
summation order and in exp's last bits; bf16 runs also round the output once.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_twins import (
    bf16_pair_scores,
    paged_attention_twin,
    prefill_attention_blocks_reference,
    store_kv_twin,
)
from test_kernels import FP8_DTYPE, Pool, assert_matches_reference, dtype_id, make_batch

from common.model.llama import RMSNorm, RotaryApply
from common.model.mlp import SiluAndMul
from kernels import timing
from kernels.argmax import argmax_rows
from kernels.cpu import library as cpu_library
from kernels.cpu import linear as cpu_linear
from kernels.cpu import tile_choice
from kernels.cpu.backend import SHORT_QUERY_MAX, CpuAttentionBackend
from kernels.cpu.library import CpuKernelsUnavailable
from kernels.cpu.linear import (
    BF16_BLAS,
    BLAS_ONLY,
    BOTH,
    FLOAT32_BLAS,
    ONEDNN_PACKED_MAX_ROWS,
    TILES_ONLY,
    CpuLinear,
    GemmPlan,
    choose_gemm_plan,
    onednn_reorders_bf16,
    unpack_tiles,
)
from kernels.cpu.ops import CpuRMSNorm, CpuRotaryApply, CpuSiluAndMul
from kernels.interface import INT8_DTYPE, INT8_SCALE_DTYPE, AttentionMetadata
from kernels.kv_formats import int8_scale
from kernels.registry import get_attention_backend
from kernels.torch_backend import sequence_context

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels")

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
# Page dtypes besides the model's own; both dequantise exactly, so they add no tolerance.
KV_DTYPES = pytest.mark.parametrize(
    "kv_dtype", ["model", FP8_DTYPE, INT8_DTYPE], ids=["kv=model", "kv=fp8", "kv=int8"]
)


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    try:
        return CpuAttentionBackend()
    except CpuKernelsUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")


@pytest.fixture(params=list(tile_choice.BF16_TILES))
def bf16_tiles(request, backend) -> str:
    """Each bf16 tile kernel this machine runs (FMAs everywhere; AVX512_BF16 and AMX where the
    processor has them), for the test's whole body: tiles packed inside are laid out for it."""
    if not cpu_library.bf16_tiles_available(request.param):
        pytest.skip(f"this processor does not run bf16 tiles with {request.param}")
    with cpu_library.running_bf16_tiles(request.param):
        yield request.param


@pytest.fixture(params=[False, True], ids=["scores=f32", "scores=bf16-pairs"])
def pair_scores(request, backend) -> bool:
    """Decode attention's two ways of scoring bf16 queries over bf16 pages (widened float32
    FMAs; bf16 pairs, where the processor has AVX512_BF16), for the test's whole body."""
    if request.param and not cpu_library.bf16_pair_scores_available():
        pytest.skip("this processor has no AVX512_BF16")
    if request.param and request.node.callspec.params.get("dtype") == torch.float32:
        pytest.skip("float32 queries are scored in float32 either way")
    with cpu_library.running_bf16_pair_scores(request.param):
        yield request.param


@pytest.fixture(params=["sdpa", "amx"])
def prefill_kernel(request, backend) -> str:
    """Each way this machine attends long chunks of bf16 queries over bf16 pages (SDPA
    everywhere; the AMX kernel where the processor has AMX), for the test's whole body."""
    library = cpu_library.load()
    if request.param == "amx" and not library.pdserve_prefill_attention_available():
        pytest.skip("this processor has no AMX")
    previous = backend.prefill_on_amx
    backend.prefill_on_amx = request.param == "amx"
    try:
        yield request.param
    finally:
        backend.prefill_on_amx = previous


@pytest.fixture
def amx_prefill(backend) -> CpuAttentionBackend:
    """The backend with long bf16 chunks on the AMX kernel; skips where there is no AMX."""
    if not cpu_library.load().pdserve_prefill_attention_available():
        pytest.skip("this processor has no AMX")
    previous = backend.prefill_on_amx
    backend.prefill_on_amx = True
    try:
        yield backend
    finally:
        backend.prefill_on_amx = previous


# ---------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@KV_DTYPES
@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim", [(2, 1, 64), (2, 3, 32), (1, 4, 80), (1, 5, 128)]
)
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1] * 5, [1, 16, 17, 100, 257]),  # decode rows, contexts on and off page edges
        ([4, 1, 7], [4, 30, 70]),  # verification runs: a whole prompt, a decode, a run of 7
        ([1, 40, 3, 1], [9, 90, 33, 64]),  # a long chunk (SDPA) among short rows
    ],
    ids=["decode", "short-runs", "mixed"],
)
def test_attention_matches_reference(
    backend, pair_scores, dtype, kv_dtype, num_kv_heads, group, head_dim, query_lens, seq_lens
) -> None:
    kv_dtype = dtype if kv_dtype == "model" else kv_dtype
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    scale = head_dim**-0.5
    plan = backend.plan(batch.meta)
    out = backend.attention(batch.query, batch.cache, plan, scale)
    expected = paged_attention_twin(batch.query, batch.cache, batch.meta, scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert not out.isnan().any(), "read a slot past a sequence's end"
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@KV_DTYPES
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(3, 3, 64), (1, 4, 80)])
def test_a_chunk_after_a_prefix_attends_prefix_and_chunk_apart(
    backend, prefill_kernel, dtype, kv_dtype, num_kv_heads, group, head_dim
) -> None:
    """Long chunks after cached prefixes of one token, a page edge and more than the chunk, and
    one with none, attend their prefix and their own keys in two SDPA calls merged by their
    log-sum-exps: the one-call reference's result within one extra rounding of each partial
    output. A chunk with no prefix is one call, the reference's very bits. (On the AMX kernel,
    where it takes the shapes, the float32 reference's result within tolerance.)"""
    kv_dtype = dtype if kv_dtype == "model" else kv_dtype
    query_lens, seq_lens = [40, 33, 70, 50], [41, 65, 300, 50]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    scale = head_dim**-0.5
    plan = backend.plan(batch.meta)
    assert len(plan.long_chunks) == 4
    out = backend.attention(batch.query, batch.cache, plan, scale)
    wide = batch.query.float()  # the reference in float32: both roundings are the kernel's
    expected = paged_attention_twin(wide, batch.cache, batch.meta, scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    sdpa = prefill_kernel == "sdpa" or not backend._amx_takes(batch.query, batch.cache)
    if dtype == torch.bfloat16 and not backend._widen_long_chunks and sdpa:
        # The merge rounds each partial output once more: at most one bf16 step apart.
        one_call = paged_attention_twin(batch.query, batch.cache, batch.meta, scale)
        assert torch.equal(out[-50:], one_call[-50:])
        assert (out.float() - one_call.float()).abs().max() <= 2 * 2**-7 * one_call.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@KV_DTYPES
def test_whole_prompts_of_one_length_attend_as_one_batch(
    backend, prefill_kernel, dtype, kv_dtype
) -> None:
    """Runs of whole prompts of one length in consecutive rows attend as one SDPA batch; a
    prompt of another length, a chunk after a prefix and short runs break the runs. Every row
    is what attending its chunk alone gives, bit for bit, and the reference's within tolerance."""
    kv_dtype = dtype if kv_dtype == "model" else kv_dtype
    query_lens = [40, 40, 40, 3, 40, 40, 33, 30, 40]
    seq_lens = [40, 40, 40, 20, 40, 40, 33, 70, 40]
    batch = make_batch(
        query_lens, seq_lens, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, kv_dtype=kv_dtype
    )
    scale = 0.125
    plan = backend.plan(batch.meta)
    runs = [(b.first_row, b.num_prompts, b.length, b.seqs) for b in plan.prompt_batches]
    assert runs == [(0, 3, 40, (0, 1, 2)), (123, 2, 40, (4, 5))]
    out = backend.attention(batch.query, batch.cache, plan, scale)
    starts = batch.meta.query_start_loc.tolist()
    for seq, (start, end) in enumerate(itertools.pairwise(starts)):
        if end - start <= SHORT_QUERY_MAX:
            continue
        alone = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=batch.meta.seq_lens[seq : seq + 1],
            page_tables=batch.meta.page_tables[seq : seq + 1],
            slot_mapping=batch.meta.slot_mapping[start:end],
            max_query_len=end - start,
            max_seq_len=seq_lens[seq],
        )
        expected = backend.attention(batch.query[start:end], batch.cache, alone, scale)
        assert torch.equal(out[start:end], expected)
    reference = paged_attention_twin(batch.query, batch.cache, batch.meta, scale)
    torch.testing.assert_close(out.float(), reference.float(), **TOLERANCE[dtype])


def assert_each_chunk_is_its_twin(out: torch.Tensor, batch, scale: float) -> None:
    """Each sequence's rows of ``out`` are the AMX kernel's twin over its gathered context, but
    for under 1% of them, each off by about a bf16 step."""
    starts = batch.meta.query_start_loc.tolist()
    for seq, (start, end) in enumerate(itertools.pairwise(starts)):
        query = batch.query[start:end]
        seq_len = int(batch.meta.seq_lens[seq])
        _, keys, values = sequence_context(query, batch.cache, batch.meta.page_tables[seq], seq_len)
        # SDPA's [1, kv_heads, seq_len, head_dim] back to the pages' [seq_len, kv_heads, head_dim].
        twin = prefill_attention_blocks_reference(
            query, keys[0].transpose(0, 1), values[0].transpose(0, 1), scale
        )
        assert (out[start:end] != twin).float().mean() < 0.01, f"sequence {seq}"
        torch.testing.assert_close(out[start:end].float(), twin.float(), atol=2**-8, rtol=2**-7)


@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim", [(3, 3, 64), (2, 1, 32), (1, 5, 128), (2, 4, 96)]
)
@pytest.mark.parametrize("softmax_scale", [None, 1.0], ids=["scale=default", "scale=1"])
def test_amx_prefill_attention_is_its_twin(
    amx_prefill, num_kv_heads, group, head_dim, softmax_scale
) -> None:
    """Chunks of whole prompts and after cached prefixes, of 17 to 300 rows (short last query
    blocks, contexts off key-block and page edges), attend on AMX as their twin does: the same
    blocks and roundings, so only a rare output differs, by about a bf16 step. Scores scaled
    by 1 are peaked: rows' maxima grow block after block and rescale what came before."""
    query_lens, seq_lens = [40, 33, 70, 50, 17, 300], [41, 65, 300, 50, 17, 300]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
    )
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    assert amx_prefill._amx_takes(batch.query, batch.cache)
    out = amx_prefill.attention(batch.query, batch.cache, amx_prefill.plan(batch.meta), scale)
    assert not out.isnan().any(), "read a slot past a sequence's end"
    assert_each_chunk_is_its_twin(out, batch, scale)
    wide = paged_attention_twin(batch.query.float(), batch.cache, batch.meta, scale)
    torch.testing.assert_close(out.float(), wide, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("page_size", [5, 64])
def test_amx_prefill_reads_pages_of_any_size_over_long_contexts(amx_prefill, page_size) -> None:
    """Pages that split key blocks (5 tokens) or hold a whole one (64), a 2048-row chunk after
    a 1000-token prefix and a 17-row one after 3000, on two threads: the twin's result."""
    query_lens, seq_lens = [2048, 17], [3048, 3017]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        page_size=page_size,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = amx_prefill.attention(batch.query, batch.cache, amx_prefill.plan(batch.meta), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert not out.isnan().any(), "read a slot past a sequence's end"
    assert_each_chunk_is_its_twin(out, batch, 0.125)


def test_amx_prefill_gives_a_row_the_same_bits_however_the_prompt_is_chunked(amx_prefill) -> None:
    """A row's output depends on its position alone: a 150-token prompt attended whole, in
    chunks of 17, 64 and 69 rows after the cached rows before them, and beside another prompt,
    on one thread or two, gives every row the same bits."""
    whole = make_batch(
        [150, 40],
        [150, 40],
        num_kv_heads=3,
        group=3,
        head_dim=64,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
    )
    scale = 0.125
    expected = amx_prefill.attention(whole.query, whole.cache, amx_prefill.plan(whole.meta), scale)[
        :150
    ]
    for first, end in [(0, 17), (17, 81), (81, 150)]:
        chunk = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - first], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            page_tables=whole.meta.page_tables[:1],
            slot_mapping=whole.meta.slot_mapping[first:end],
            max_query_len=end - first,
            max_seq_len=end,
        )
        alone = amx_prefill.attention(whole.query[first:end], whole.cache, chunk, scale)
        assert torch.equal(alone, expected[first:end]), (first, end)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = amx_prefill.attention(whole.query, whole.cache, amx_prefill.plan(whole.meta), scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two[:150], expected)


@pytest.mark.parametrize(
    "dtype, kv_dtype, head_dim",
    [
        (torch.float32, torch.float32, 64),  # float32: SDPA's
        (torch.bfloat16, FP8_DTYPE, 64),  # quantised pages: SDPA's
        (torch.bfloat16, torch.bfloat16, 80),  # head_dim not a multiple of 32: SDPA's
        (torch.bfloat16, torch.bfloat16, 64),  # the AMX kernel's
    ],
)
def test_the_amx_prefill_takes_only_bf16_pages_in_its_shapes(
    amx_prefill, dtype, kv_dtype, head_dim
) -> None:
    batch = make_batch(
        [40], [60], num_kv_heads=2, group=2, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype
    )
    takes = dtype == kv_dtype == torch.bfloat16 and head_dim % 32 == 0
    assert amx_prefill._amx_takes(batch.query, batch.cache) == takes
    scale = head_dim**-0.5
    out = amx_prefill.attention(batch.query, batch.cache, amx_prefill.plan(batch.meta), scale)
    assert_matches_reference(out, batch, dtype)


def test_int8_scale_codes_decode_as_in_the_twin(backend) -> None:
    """All 256 scale codes, one per sequence: over a one-token context the softmax weight is
    exactly 1, so a float32 output row is its value row dequantised, with no rounding in
    between. head_dim 20 runs the kernel's vector loads and its scalar tail."""
    num_codes, page_size, head_dim = 256, 4, 20
    pool = Pool.create(
        num_codes + 1, page_size=page_size, num_kv_heads=1, head_dim=head_dim, dtype=INT8_DTYPE
    )
    cache = pool.layer(1)
    assert cache.key_scale is not None and cache.value_scale is not None
    codes = torch.arange(num_codes).to(INT8_SCALE_DTYPE)
    values = torch.randint(-128, 128, (num_codes, head_dim), dtype=INT8_DTYPE)
    values[:, :2] = torch.tensor([-128, 127], dtype=INT8_DTYPE)
    pages = torch.arange(1, num_codes + 1)  # page 0 stays unwritten
    cache.key[pages, 0, 0] = 0
    cache.key_scale[pages, 0, 0] = 0
    cache.value[pages, 0, 0] = values
    cache.value_scale[pages, 0, 0] = codes
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_codes + 1, dtype=torch.int32),
        seq_lens=torch.ones(num_codes, dtype=torch.int32),
        page_tables=pages.to(torch.int32)[:, None],
        slot_mapping=pages * page_size,
        max_query_len=1,
        max_seq_len=1,
    )
    out = backend.attention(torch.randn(num_codes, 1, head_dim), cache, meta, 1.0)
    assert torch.equal(out[:, 0], values.float() * int8_scale(codes)[:, None])


def test_plan_splits_short_runs_from_long_chunks(backend) -> None:
    batch = make_batch(
        [1, SHORT_QUERY_MAX, SHORT_QUERY_MAX + 1],
        [5, 40, 60],
        num_kv_heads=2,
        group=2,
        head_dim=32,
        dtype=torch.float32,
        kv_dtype=torch.float32,
    )
    plan = backend.plan(batch.meta)
    assert plan.short_seq_ids.tolist() == [0, 1]
    assert [chunk[0] for chunk in plan.long_chunks] == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@KV_DTYPES
@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim", [(3, 3, 64), (2, 2, 32), (1, 4, 80), (1, 5, 128)]
)
def test_deterministic_attention_gives_a_position_the_same_bits_however_it_is_batched(
    backend, pair_scores, dtype, kv_dtype, num_kv_heads, group, head_dim
) -> None:
    """A token's attention output depends on its position and the context before it, never on
    how the step around it was cut: one 75-row prefill, decode rows one by one, or chunks of
    other sizes (a chunk after a cached prefix, a run of one, runs longer than a row tile). On
    AVX2 and AVX-512, short runs over bf16 pages read them in place and long ones through a
    buffer: both are checked against each other here, as are bf16 pair scores, which every
    run length takes."""
    deterministic = CpuAttentionBackend(deterministic=True)
    batch = make_batch(
        [75],
        [75],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=dtype if kv_dtype == "model" else kv_dtype,
    )
    scale = head_dim**-0.5
    whole = deterministic.attention(batch.query, batch.cache, batch.meta, scale)
    cut_lists = ([0, 1, 2, 3, 75], list(range(76)), [0, 20, 21, 60, 75], [0, 16, 33, 70, 75],
                 [0, 2, 5, 9, 75])  # fmt: skip
    for cuts in cut_lists:
        lens = [end - start for start, end in itertools.pairwise(cuts)]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(cuts, dtype=torch.int32),
            seq_lens=torch.tensor(cuts[1:], dtype=torch.int32),
            page_tables=batch.meta.page_tables.expand(len(lens), -1),
            slot_mapping=batch.meta.slot_mapping,
            max_query_len=max(lens),
            max_seq_len=75,
        )
        assert torch.equal(deterministic.attention(batch.query, batch.cache, meta, scale), whole)
    torch.testing.assert_close(
        whole.float(),
        paged_attention_twin(batch.query, batch.cache, batch.meta, scale).float(),
        **TOLERANCE[dtype],
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_bf16_pair_scores_are_their_twins_bit_for_bit(backend, head_dim) -> None:
    """vdpbf16ps's scores against tests/kernel_twins.py's bf16_pair_scores: keys rows apart as
    in a page (the row stride wider than a head), a count that ends inside a group of eight,
    a softmax scale that is not a power of two."""
    if not cpu_library.bf16_pair_scores_available():
        pytest.skip("this processor has no AVX512_BF16")
    generator = torch.Generator().manual_seed(head_dim)
    query = torch.randn(head_dim, generator=generator).to(torch.bfloat16)
    rows = torch.randn(27, 3 * head_dim, generator=generator).to(torch.bfloat16)
    keys = rows[:, head_dim : 2 * head_dim]
    scores = torch.full((27,), float("nan"))
    status = cpu_library.load().pdserve_bf16_pair_scores_of(
        query.data_ptr(),  # [head_dim] bf16
        keys.data_ptr(), rows.stride(0),  # [27, head_dim] bf16 rows, and their row stride
        27, head_dim, 0.3,  # rows, head_dim, softmax scale
        scores.data_ptr(),  # [27] float32 out
    )  # fmt: skip
    assert status == 0
    assert torch.equal(scores, bf16_pair_scores(query, keys, 0.3))
    # The order is the products' own: the plain float32 dot product differs in its last bits.
    torch.testing.assert_close(scores, (keys.float() @ query.float()) * 0.3, atol=1e-5, rtol=1e-5)


def test_bf16_pair_scores_are_taken_only_where_asked_for_and_available(monkeypatch) -> None:
    library = cpu_library.load()
    monkeypatch.delenv(tile_choice.ENV_BF16_PAIR_SCORES, raising=False)
    assert not tile_choice.pair_scores_wanted(library)
    monkeypatch.setenv(tile_choice.ENV_BF16_PAIR_SCORES, "1")
    assert tile_choice.pair_scores_wanted(library) == cpu_library.bf16_pair_scores_available()


def test_attention_reads_query_views_of_a_fused_projection(backend) -> None:
    """q as a strided view of a qkv buffer (what the model hands over) attends as a copy does."""
    batch = make_batch(
        [1, 1, 3],
        [20, 33, 8],
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
    )
    num_tokens, heads, dim = batch.query.shape
    fused = torch.randn(num_tokens, heads * dim + 2 * 2 * dim).to(torch.bfloat16)
    fused[:, : heads * dim] = batch.query.reshape(num_tokens, -1)
    view = fused[:, : heads * dim].reshape(num_tokens, heads, dim)
    plan = backend.plan(batch.meta)
    assert torch.equal(
        backend.attention(view, batch.cache, plan, 0.125),
        backend.attention(batch.query, batch.cache, plan, 0.125),
    )


def test_registry_picks_the_cpu_backend_on_a_cpu(monkeypatch, backend) -> None:
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)
    assert get_attention_backend(torch.device("cpu")).name == "cpu"


def test_registry_falls_back_to_torch_without_a_compiler(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)

    def unavailable():
        raise CpuKernelsUnavailable("no C compiler (gcc or cc) on PATH")

    monkeypatch.setattr("kernels.cpu.library.load", unavailable)
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "cpu")
    with pytest.raises(ValueError, match="unavailable"):
        get_attention_backend(torch.device("cpu"))


def test_a_failed_build_is_tried_once(monkeypatch, tmp_path) -> None:
    """A build that fails is not run again in the process: ``available`` is asked per step, and
    each try would be a compiler run. ``load`` keeps raising the build's own error."""
    builds = []

    def failing_build(compiler, target) -> None:
        builds.append(target)
        raise CpuKernelsUnavailable("cc failed: error: unknown type name")

    monkeypatch.setattr(cpu_library, "_build", failing_build)
    monkeypatch.setattr(cpu_library, "cache_dir", lambda: tmp_path)  # no library built there
    cpu_library._load_once.cache_clear()
    try:
        assert not cpu_library.available()
        assert not cpu_library.available()
        with pytest.raises(CpuKernelsUnavailable, match="unknown type name"):
            cpu_library.load()
        # The callers fall back to torch.
        x = torch.randn(3, 50)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert len(builds) == 1
    finally:
        cpu_library._load_once.cache_clear()  # the next caller loads the real library


# ---------------------------------------------------------------------------------------------
# Linear layers


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (50, 160), (33, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_tiles_equal_an_fp32_gemm_rounded_once(
    bf16_tiles, rows, out_features, in_features, bias
) -> None:
    """Exact products, float32 sums, one rounding: the fp32 GEMM of the same values rounded to
    bf16, up to the last bit where the two sum in another order: in at most 2% of the outputs,
    or one where there are fewer than 50 (a sum that cancels to near zero, 4.1e-5 against
    4.05e-5 from terms of size 10, can round either way)."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + bias)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias_values = (
        torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    )
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    linear = CpuLinear(weight, bias_values, TILES_ONLY)
    out = linear(x)
    expected = F.linear(
        x.float(), weight.float(), None if bias_values is None else bias_values.float()
    )
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=1e-2, rtol=8e-3)
    mismatches = int((out != expected.bfloat16()).sum())
    assert mismatches <= max(1, 0.02 * out.numel())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_packed_tiles_hold_the_weight_in_the_order_the_kernel_reads(bf16_tiles, dtype) -> None:
    """Packing is a permutation (plus zero columns past N): unpacking gives the weight back, and
    a one-hot row of x reads back one k-row of the weight, so the kernel finds every column where
    the packing put it."""
    weight = torch.randn(70, 40).to(dtype)
    linear = CpuLinear(weight, None, TILES_ONLY)
    assert torch.equal(unpack_tiles(linear.packed_tiles, 70, 40), weight)
    one_hot = torch.eye(40, dtype=dtype)
    for rows in (1, 2, 5, 40):  # each of the kernel's register blocks
        assert torch.equal(linear(one_hot[:rows]), weight.t()[:rows])


BF16_BLAS_ONLY = GemmPlan(tile_max_rows=0, blas_dtype=BF16_BLAS)


@pytest.mark.parametrize(
    "plan", [TILES_ONLY, BLAS_ONLY, BF16_BLAS_ONLY, BOTH], ids=lambda p: p.describe()
)
def test_cpu_linear_keeps_only_what_its_plan_uses(backend, plan) -> None:
    linear = CpuLinear(torch.randn(64, 32).to(torch.bfloat16), None, BOTH)
    linear.restrict(plan)
    assert (linear.packed_tiles is not None) == plan.uses_tiles
    assert (linear.weight_t32 is not None) == plan.uses_float32_blas
    assert (linear.weight_bf16 is not None) == plan.uses_bf16_blas
    x = torch.randn(200, 32).to(torch.bfloat16)
    expected = F.linear(x.float(), linear_weight(linear)).bfloat16()
    for rows in (1, 8, 200):
        torch.testing.assert_close(
            linear(x[:rows]).float(), expected[:rows].float(), atol=1e-2, rtol=8e-3
        )


def linear_weight(linear: CpuLinear) -> torch.Tensor:
    if linear.weight_bf16 is not None:
        return linear.weight_bf16.float()
    if linear.weight_t32 is not None:
        return linear.weight_t32.t()
    return unpack_tiles(linear.packed_tiles, linear.out_features, linear.in_features).float()


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_blas_equals_an_fp32_gemm_rounded_once(backend, rows, bias) -> None:
    """oneDNN's bf16 GEMM (AMX or ``vdpbf16ps`` where the processor has them, emulated where
    not): exact products summed in float32, rounded once, so within a bf16 step of the float32
    GEMM of the same values, and the same values whichever rows share the call's block."""
    weight = torch.randn(96, 320).to(torch.bfloat16)
    bias_values = torch.randn(96).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 320).to(torch.bfloat16)
    linear = CpuLinear(weight, bias_values, BF16_BLAS_ONLY)
    assert linear.weight_t32 is None and linear.packed_tiles is None
    out = linear(x)
    expected = F.linear(
        x.float(), weight.float(), None if bias_values is None else bias_values.float()
    )
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), atol=1e-2, rtol=8e-3)
    assert (out != expected.bfloat16()).float().mean() < 0.05


@pytest.mark.parametrize("rows", [1, 64, ONEDNN_PACKED_MAX_ROWS, ONEDNN_PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_blas_over_the_reordered_weight_is_torchs_bf16_linear(backend, rows, bias) -> None:
    """Up to ONEDNN_PACKED_MAX_ROWS rows the bf16 BLAS multiplies the weight oneDNN reordered at
    load, beyond it torch's bf16 linear: the same bits either way, strided inputs included, so
    the switch changes no token. Where oneDNN cannot reorder bf16 (an AVX2-only core) the layer
    holds no reordered weight and runs torch's bf16 linear at every row count."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    weight = torch.randn(96, 320).to(torch.bfloat16)
    bias_values = torch.randn(96).to(torch.bfloat16) if bias else None
    linear = CpuLinear(weight, bias_values, BF16_BLAS_ONLY)
    assert (linear.weight_onednn is not None) == onednn_reorders_bf16()
    x = torch.randn(rows, 400).to(torch.bfloat16)[:, 40:360]  # rows 400 apart
    assert torch.equal(linear(x), F.linear(x, weight, bias_values))
    float32_blas = CpuLinear(weight, bias_values, BOTH)
    float32_blas.restrict(BLAS_ONLY)
    assert float32_blas.weight_onednn is None


def test_a_float32_layer_never_takes_the_bf16_blas(backend) -> None:
    """An int8 pool's turns stay float32 inside a bf16 model: a plan whose BLAS is bf16's runs
    them through float32's, bit for bit, rather than rounding their inputs to bf16."""
    weight, x = torch.randn(40, 40), torch.randn(300, 40)
    linear = CpuLinear(weight, None, BOTH)
    linear.restrict(BF16_BLAS_ONLY)
    assert linear.weight_bf16 is None and linear.weight_t32 is not None
    assert torch.equal(linear(x), torch.mm(x, weight.t().contiguous()))


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_the_probe_takes_bf16_blas_only_where_it_is_faster(
    backend, tmp_path, monkeypatch, bf16_faster
) -> None:
    """Which BLAS is the first question the probe asks, at a prefill-sized row count: bf16's
    where the processor's bf16 units beat float32 MKL, float32's where bf16 is emulated. The
    answer is stored with the plan and every later process reads it back."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    timed: list[str] = []

    def first_is_faster(first, second, rounds: int = 4) -> bool:
        timed.clear()
        first()
        second()
        if {"forward_bf16_blas", "forward_float32_blas"} <= set(timed):  # BLAS against BLAS
            return bf16_faster
        return False  # the tiles lose at every row count

    def record(kernel):
        def run(self, x):
            timed.append(kernel.__name__)
            return kernel(self, x)

        return run

    for kernel in (CpuLinear.forward_bf16_blas, CpuLinear.forward_float32_blas):
        monkeypatch.setattr(CpuLinear, kernel.__name__, record(kernel))
    monkeypatch.setattr(cpu_linear, "first_is_faster", first_is_faster)
    linears = [CpuLinear(torch.randn(64, 32).to(torch.bfloat16), None, BOTH) for _ in range(2)]
    plan = choose_gemm_plan(linears)
    expected = BF16_BLAS if bf16_faster else FLOAT32_BLAS
    assert plan == GemmPlan(tile_max_rows=0, blas_dtype=expected)
    monkeypatch.setattr(cpu_linear, "first_is_faster", None)  # never probed again
    assert choose_gemm_plan(linears) == plan
    for linear in linears:
        linear.restrict(plan)
        assert (linear.weight_bf16 is not None) == bf16_faster
        assert (linear.weight_t32 is not None) != bf16_faster


def spread_bf16(*shape: int, seed: int) -> torch.Tensor:
    """bf16 values over twenty binades: sums of their products round at every step, so two
    summation orders give different bits and a twin must follow the kernel's own. Seeded: the
    AMX twin's tolerance holds for these values, not for every cancellation chance could
    bring."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-10, 10, shape, generator=generator).float())
    return (torch.randn(shape, generator=generator) * scales).to(torch.bfloat16)


def sequential_twin(x: torch.Tensor, weight: torch.Tensor, k_order) -> torch.Tensor:
    """x W^T summed one product at a time in float32 (each product exact) in ``k_order``'s
    order, rounded to bf16 once."""
    x32, w32 = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in k_order:
        acc = acc + x32[:, k : k + 1] * w32[:, k]
    return acc.bfloat16()


def test_each_bf16_tile_kernel_sums_in_its_own_order(bf16_tiles) -> None:
    """Each kernel against its twin, bit for bit where its order is one product at a time:
    FMAs k = 0, 1, 2, ...; vdpbf16ps each pair's second product, then its first. AMX sums a
    block of sixteen pairs in the hardware's own way (the manual leaves it open) and adds it to
    the float32 sum once: its twin is the exact block sum, and the two differ by at most a
    float32 rounding of each of the block's 32 products (which, where they cancel, can be more
    than a bf16 step of the result) and a bf16 step, rarely."""
    weight, x = spread_bf16(256, 256, seed=1), spread_bf16(24, 256, seed=2)
    out = CpuLinear(weight, None, TILES_ONLY)(x)
    if bf16_tiles == "amx":
        x64, w64 = x.double(), weight.double()
        acc = torch.zeros(24, 256)
        for k0 in range(0, 256, 32):
            block = x64[:, k0 : k0 + 32] @ w64[:, k0 : k0 + 32].t()
            acc = (acc.double() + block).float()
        twin = acc.bfloat16()
        terms = x64.abs() @ w64.abs().t()  # the scale of every rounding inside the sums
        allowed = twin.double().abs() * 2**-7 + terms * 2**-19
        assert ((out.double() - twin.double()).abs() <= allowed).all()
        assert (out != twin).float().mean() < 0.005
        return
    order = range(256)
    if bf16_tiles == "dpbf16":
        order = [k for pair in range(0, 256, 2) for k in (pair + 1, pair)]
    assert torch.equal(out, sequential_twin(x, weight, order))


def test_amx_tiles_survive_onednn_loading_its_own_tile_shapes(bf16_tiles) -> None:
    """A thread keeps the AMX kernel's tile configuration between calls; oneDNN's bf16 GEMMs
    (prefill's BLAS) load their own on the same thread, and the next tile call must notice."""
    weight, x = torch.randn(96, 320).to(torch.bfloat16), torch.randn(20, 320).to(torch.bfloat16)
    linear = CpuLinear(weight, None, TILES_ONLY)
    before = linear(x)
    big = torch.randn(512, 512).to(torch.bfloat16)
    F.linear(big, big)  # oneDNN: AMX where there is AMX, with tiles of its own shapes
    assert torch.equal(linear(x), before)


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_tiles_equal_an_fp32_gemm(backend, rows, bias) -> None:
    weight, x = torch.randn(70, 300), torch.randn(rows, 300)
    bias_values = torch.randn(70) if bias else None
    out = CpuLinear(weight, bias_values, TILES_ONLY)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 70)
    torch.testing.assert_close(out, F.linear(x, weight, bias_values), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_tiles_give_a_row_the_same_bits_whatever_rows_share_the_call(bf16_tiles, dtype) -> None:
    """A row's output must not depend on how many rows the step has, nor on where the row sits
    among them: that is what keeps a sequence's tokens independent of the batch (and of
    speculation, which adds rows). K spans several of the kernel's chunks."""
    linear = CpuLinear(torch.randn(80, 300).to(dtype), torch.randn(80).to(dtype), TILES_ONLY)
    x = torch.randn(41, 300).to(dtype)
    together = linear(x)
    for rows in (1, 2, 3, 6, 7, 8, 9, 13, 17):
        assert torch.equal(linear(x[:rows]), together[:rows])
    for row in (5, 40):
        assert torch.equal(linear(x[row : row + 1]), together[row : row + 1])
    assert torch.equal(linear(x[3:20]), together[3:20])


def test_probe_returns_a_usable_plan(backend, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    linears = [CpuLinear(torch.randn(64, 32).to(torch.bfloat16), None, BOTH) for _ in range(2)]
    plan = choose_gemm_plan(linears)
    assert plan.uses_tiles or plan.uses_blas
    for linear in linears:
        linear.restrict(plan)
        assert linear(torch.randn(3, 32).to(torch.bfloat16)).shape == (3, 64)


def test_the_probe_feeds_each_layer_its_own_dtype(backend, tmp_path, monkeypatch) -> None:
    """An int8 pool's turns stay float32 inside a bf16 model (kernels/kv_turn.py); the probe
    runs every layer, so it must not hand them bf16 rows."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    linears = [
        CpuLinear(torch.randn(64, 32).to(torch.bfloat16), None, BOTH),
        CpuLinear(torch.randn(32, 32), None, BOTH),
    ]
    plan = choose_gemm_plan(linears)
    for linear in linears:
        linear.restrict(plan)
    assert linears[1](torch.randn(3, 32)).dtype == torch.float32


def test_the_machine_keeps_the_first_plan_it_chose(backend, tmp_path, monkeypatch) -> None:
    """Timings are noisy: were every process to probe for itself, two workers could sum in
    different orders and round bf16 differently. The first plan written is everyone's."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    linears = [CpuLinear(torch.randn(96, 64).to(torch.bfloat16), None, BOTH) for _ in range(3)]
    first = choose_gemm_plan(linears)
    [stored] = (tmp_path / "kernels").glob("gemm-plan-*.json")
    assert all(choose_gemm_plan(linears) == first for _ in range(3))
    # Whatever the file says is what every later process runs; garbage there is probed over.
    stored.write_text(json.dumps({"tile_max_rows": 7}))
    assert choose_gemm_plan(linears) == GemmPlan(tile_max_rows=7)
    stored.write_text("{not json")
    probed = choose_gemm_plan(linears)
    assert json.loads(stored.read_text()) == {
        "tile_max_rows": probed.tile_max_rows,
        "blas_dtype": probed.blas_dtype,
    }
    # Other shapes are another plan.
    other = [CpuLinear(torch.randn(32, 64).to(torch.bfloat16), None, BOTH)]
    choose_gemm_plan(other)
    assert len(list((tmp_path / "kernels").glob("gemm-plan-*.json"))) == 2


def test_a_burst_of_other_work_does_not_reverse_the_probes_verdict(monkeypatch) -> None:
    """The probe persists its verdict, so it must hold on a busy machine: a burst of other work
    slowing a run of consecutive calls (here the first three, five times over) must not make
    the kernel twice as fast look the slower. Timing one kernel's calls back to back lets the
    burst cover all of them; taking turns leaves each kernel calls outside it."""
    clock = [0.0]
    calls = [0]

    def kernel(cost: float):
        def run() -> None:
            clock[0] += cost * (5.0 if calls[0] < 3 else 1.0)
            calls[0] += 1

        return run

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    assert timing.first_is_faster(kernel(1.0), kernel(2.0))
    calls[0] = 0
    assert not timing.first_is_faster(kernel(2.0), kernel(1.0))


@pytest.mark.skipif(
    not Path("/proc/thread-self/schedstat").exists(), reason="no per-thread scheduler figures"
)
def test_a_call_is_timed_by_its_running_time_not_its_wait_for_a_core() -> None:
    """On a machine whose cores are busy a call spends much of its wall time waiting for one;
    the probe leaves that out. Here a busy process shares this thread's core, so the call's wall
    time is about twice its running time."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {core})
        work = torch.randn(256, 256)
        for _ in range(20):  # until the busy process shares the core: a call then waits
            start = time.perf_counter()
            running = timing.running_seconds(lambda: [work @ work for _ in range(200)])
            wall = time.perf_counter() - start
            if wall > 1.5 * running:
                break
        assert wall > 1.5 * running
    finally:
        busy.kill()
        busy.wait()
        os.sched_setaffinity(0, before)


class FakeTileLibrary:
    """The library's bf16 tile switches over the kinds ``available`` names, recording the
    kernel each tile GEMM ran with and its shape: what ``_machine_bf16_tiles`` decides by."""

    def __init__(self, available: set[str]) -> None:
        self.available = available
        self.kind = tile_choice.BF16_TILES["fma"]
        self.calls: list[tuple[str, int, int]] = []  # (kernel, rows, threads)

    def name(self, code: int) -> str:
        return next(k for k, v in tile_choice.BF16_TILES.items() if v == code)

    def pdserve_bf16_tiles_available(self, code: int) -> int:
        return int(self.name(code) in self.available)

    def pdserve_use_bf16_tiles(self, code: int) -> int:
        if self.name(code) not in self.available:
            return -1
        self.kind = code
        return 0

    def pdserve_bf16_tiles(self) -> int:
        return self.kind

    def pdserve_linear_bf16(self, x, x_stride, packed, bias, y, y_stride, m, n, k, threads) -> int:
        self.calls.append((self.name(self.kind), m, threads))
        return 0


@pytest.mark.parametrize("dpbf16_faster_at", [(), (8,), (8, 128)])
def test_a_machine_with_avx512_bf16_keeps_the_tile_kernel_it_timed_faster(
    tmp_path, monkeypatch, dpbf16_faster_at
) -> None:
    """Without AMX, vdpbf16ps and the FMAs are timed against each other once per machine:
    vdpbf16ps must win at a decode batch and at a prefill-sized block alike. The verdict is kept
    on disk and every later process runs it, since the two kernels round differently; the
    kernel in use before the probe is in use after it."""
    library = FakeTileLibrary({"fma", "dpbf16"})

    def first_is_faster(first, second, rounds: int = 4) -> bool:
        library.calls.clear()
        first()
        [(kernel, rows, threads)] = set(library.calls)
        assert kernel == "dpbf16" and threads == 1
        assert len(library.calls) == tile_choice.BF16_TILES_PROBE_WEIGHTS
        library.calls.clear()
        second()
        assert {call[0] for call in library.calls} == {"fma"}
        return rows in dpbf16_faster_at

    monkeypatch.setattr(tile_choice, "first_is_faster", first_is_faster)
    store = tmp_path / "bf16-tiles.json"
    expected = "dpbf16" if len(dpbf16_faster_at) == 2 else "fma"
    library.kind = tile_choice.BF16_TILES["dpbf16"]  # the probe's last call ran the FMAs
    assert tile_choice.machine_bf16_tiles(library, store) == expected
    assert library.name(library.kind) == "dpbf16"
    assert json.loads(store.read_text()) == {"kernel": expected}
    monkeypatch.setattr(tile_choice, "first_is_faster", None)  # never timed again
    assert tile_choice.machine_bf16_tiles(library, store) == expected
    # Whatever the file says is what every later process runs; garbage there is timed over.
    other = "fma" if expected == "dpbf16" else "dpbf16"
    store.write_text(json.dumps({"kernel": other}))
    assert tile_choice.machine_bf16_tiles(library, store) == other
    store.write_text(json.dumps({"kernel": "amx"}))
    monkeypatch.setattr(tile_choice, "first_is_faster", first_is_faster)
    assert tile_choice.machine_bf16_tiles(library, store) == expected
    assert json.loads(store.read_text()) == {"kernel": expected}


@pytest.mark.parametrize(
    ("available", "expected"),
    [({"fma"}, "fma"), ({"fma", "dpbf16", "amx"}, "amx"), ({"fma", "amx"}, "amx")],
)
def test_a_machine_without_a_choice_to_time_runs_its_kernel_untimed(
    tmp_path, monkeypatch, available, expected
) -> None:
    """AMX, where there is AMX, beats both by several times; without AVX512_BF16 the FMAs are
    all there is. Neither times anything nor writes a choice down."""
    monkeypatch.setattr(tile_choice, "first_is_faster", None)
    store = tmp_path / "bf16-tiles.json"
    assert tile_choice.machine_bf16_tiles(FakeTileLibrary(available), store) == expected
    assert not store.exists()


def test_the_environment_names_the_bf16_tile_kernel_over_the_machines_choice(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(tile_choice, "first_is_faster", None)
    library = FakeTileLibrary({"fma", "dpbf16"})
    monkeypatch.setenv(tile_choice.ENV_BF16_TILES, "fma")
    assert tile_choice.default_bf16_tiles(library, tmp_path / "pdserve_cpu.so") == "fma"
    monkeypatch.setenv(tile_choice.ENV_BF16_TILES, "dpbf16")
    assert tile_choice.default_bf16_tiles(library, tmp_path / "pdserve_cpu.so") == "dpbf16"
    # A kernel this machine lacks falls back to the machine's own, AMX here.
    monkeypatch.setenv(tile_choice.ENV_BF16_TILES, "amx")
    library = FakeTileLibrary({"fma", "amx"})
    assert tile_choice.default_bf16_tiles(library, tmp_path / "pdserve_cpu.so") == "amx"
    assert not list(tmp_path.glob("*.json"))


def test_this_machine_chooses_a_bf16_tile_kernel_it_runs(backend, tmp_path) -> None:
    """The real library on this processor: where it has AVX512_BF16 and no AMX, the two
    kernels are timed for real over the probe's weights and the faster kept."""
    library = cpu_library.load()
    before = library.pdserve_bf16_tiles()
    store = tmp_path / "bf16-tiles.json"
    chosen = tile_choice.machine_bf16_tiles(library, store)
    assert cpu_library.bf16_tiles_available(chosen)
    assert library.pdserve_bf16_tiles() == before
    timed = cpu_library.bf16_tiles_available("dpbf16") and not cpu_library.bf16_tiles_available(
        "amx"
    )
    assert store.exists() == timed


# ---------------------------------------------------------------------------------------------
# Elementwise ops


def test_rms_norm_equals_the_torch_module(backend) -> None:
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(7, 96) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        out, expected = CpuRMSNorm(norm.weight, norm.eps)(x), norm(x)
    # Only the mean of squares is summed in another order: at most one bf16 step apart.
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=8e-3)
    assert (out != expected).float().mean() < 0.02


def test_rms_norm_rounds_denormal_outputs_as_torch_does(backend) -> None:
    """Where the processor converts 16 lanes to bf16 in one instruction, that instruction reads
    denormals as zero and the kernel rounds those lanes itself: a row of +-3 (every order of
    its sum is exact, so the norm is torch's bit for bit) times weights down in bf16's
    denormals gives torch's denormal outputs, in vector lanes and the scalar tail (width 40)."""
    signs = torch.randint(0, 2, (5, 40), generator=torch.Generator().manual_seed(1)) * 2 - 1
    x = (signs * 3.0).to(torch.bfloat16)
    norm = RMSNorm(40, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-1, 1, 40) * 2e-38)
    norm = norm.to(torch.bfloat16)
    with torch.inference_mode():
        out, expected = CpuRMSNorm(norm.weight, norm.eps)(x), norm(x)
    assert (expected.float().abs() < 1.1754944e-38).logical_and(expected != 0).any()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("hidden", [576, 100])
def test_add_and_norm_is_a_bf16_add_then_the_norm_bit_for_bit(backend, hidden) -> None:
    """The residual add fused into the norm after it: the sum rounds as torch's bf16 add does
    and its norm sums its squares in the C norm's own order (rows wider than a vector, and a
    width with a scalar tail), so the layer's numbers do not move."""
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(64, hidden, generator=generator) * 3).to(torch.bfloat16)
    delta = torch.randn(64, 2 * hidden, generator=generator).to(torch.bfloat16)[:, ::2]
    norm = CpuRMSNorm(torch.randn(hidden, generator=generator).to(torch.bfloat16), 1e-5)
    total, out = norm.add_and_norm(x, delta)
    assert torch.equal(total, x + delta)
    assert torch.equal(out, norm(x + delta))


def test_silu_and_mul_equals_the_torch_module(backend) -> None:
    gate_up = (torch.randn(5, 2 * 48) * 4).to(torch.bfloat16)
    out, expected = CpuSiluAndMul()(gate_up), SiluAndMul()(gate_up)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=8e-3)
    assert (out != expected).float().mean() < 0.02


def test_silu_and_mul_over_every_finite_bf16_gate(backend) -> None:
    """Every finite bf16 gate value, in rows far wider than the kernel's chunk of elements (and
    not a multiple of it), including the values exp's clamps cut off."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = every[torch.isfinite(every)]
    width = gates.numel() // 4
    gate = gates[: 4 * width].reshape(4, width)
    up = (torch.randn(4, width) * 2).to(torch.bfloat16)
    gate_up = torch.cat([gate, up], dim=-1)
    out, expected = CpuSiluAndMul()(gate_up), SiluAndMul()(gate_up)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=8e-3)
    assert (out != expected).float().mean() < 0.02


def test_argmax_rows_gives_torchs_indices(backend) -> None:
    """The first of equal maxima, the first NaN above any number, -inf rows, +inf, rows wider
    than the kernel's search block and not a multiple of it, strided rows, and the torch
    fallback for other dtypes."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        width = int(torch.randint(1, 300, (), generator=generator))
        x = torch.randint(-3, 4, (5, width), generator=generator).float()
        if trial % 3 == 0:
            x[torch.rand(5, width, generator=generator) < 0.05] = float("nan")
        if trial % 5 == 0:
            x[2] = float("-inf")
        if trial % 7 == 0:
            x[1, width // 2] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), x
    logits = torch.randn(8, 49216, generator=generator)[:, :49152]  # a view: rows 49216 apart
    logits[3, 40000] = logits[3, 100] = 1e4  # a tie past the first search blocks
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[3] == 100
    bf16 = logits.bfloat16()
    assert torch.equal(argmax_rows(bf16), bf16.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 7)).shape == (0,)


def test_rope_equals_the_torch_module_on_views_of_a_fused_projection(backend) -> None:
    tokens, heads, kv_heads, dim = 6, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    angles = torch.rand(tokens, dim // 2) * 10
    cos = torch.cat([angles, angles], -1).cos().to(torch.bfloat16)
    sin = torch.cat([angles, angles], -1).sin().to(torch.bfloat16)

    def views(buffer):
        q, k, _ = buffer.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)

    # The last two tokens rotate values in bf16's denormals, which the kernel rounds itself
    # where its vector conversion would read them as zero.
    qkv[-2:] *= 1e-38
    expected_q, expected_k = RotaryApply()(*views(qkv), cos, sin)
    fused = qkv.clone()
    q, k = CpuRotaryApply()(*views(fused), cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(fused[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_store_kv_writes_exactly_the_reference_slots(backend, dtype) -> None:
    """Views of a fused projection (strided rows) land in the same slots, byte for byte, and
    nothing else in the pool changes."""
    batch = make_batch(
        [3, 1], [40, 17], num_kv_heads=2, group=2, head_dim=64, dtype=dtype, kv_dtype=dtype
    )
    num_tokens = batch.meta.slot_mapping.shape[0]
    fused = torch.randn(num_tokens, 3, 2, 64).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    expected = batch.pool.clone()
    store_kv_twin(key, value, expected.layer(1), batch.meta.slot_mapping)
    backend.store_kv(key, value, batch.cache, batch.meta.slot_mapping)
    batch.pool.assert_matches(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_int8_store_quantises_exactly_as_the_twin(backend, dtype) -> None:
    """Byte for byte, codes included: views of a fused projection, outlier channels, an
    all-zero vector, values beyond the largest scale (clipped), and exact half steps."""
    batch = make_batch(
        [5, 1], [40, 17], num_kv_heads=3, group=2, head_dim=64, dtype=dtype, kv_dtype=INT8_DTYPE
    )
    num_tokens = batch.meta.slot_mapping.shape[0]
    fused = torch.randn(num_tokens, 3, 3, 64)
    fused[:, :, :, [5, 33]] *= 40
    fused[0, 1] = 0.0
    fused[1, 1, 0] = 1e7
    # 127 * 2**-4 sets the scale to 2**-4 exactly: the others fall on half steps.
    fused[2, 1, 1] = torch.arange(64) * 2.0**-5 - 1.0
    fused[2, 1, 1, 0] = 127 * 2.0**-4
    fused = fused.to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    expected = batch.pool.clone()
    store_kv_twin(key, value, expected.layer(1), batch.meta.slot_mapping)
    backend.store_kv(key, value, batch.cache, batch.meta.slot_mapping)
    assert torch.equal(batch.pool.pages.view(torch.uint8), expected.pages.view(torch.uint8))
    assert torch.equal(batch.pool.scales, expected.scales)
    assert batch.pool.scales.dtype == INT8_SCALE_DTYPE
    # The test's own vectors reached the kernel: a zero code, a clipped code, half steps.
    codes = batch.cache.key_scale.flatten()
    assert (codes == 0).any() and (codes == 255).any()


@pytest.mark.parametrize("scale", [1.0, 3.7, 1e-12, 2.0**-100, 7.6e35])
def test_fp8_pages_are_read_exactly(backend, scale) -> None:
    """Every e4m3 byte, NaNs and subnormals included, reaches attention as the byte's value times
    its scale rounded once: with one key per sequence the output is that value row itself."""
    batch = make_batch(
        [1] * 4,
        [1] * 4,
        num_kv_heads=1,
        group=1,
        head_dim=64,
        dtype=torch.float32,
        kv_dtype=FP8_DTYPE,
    )
    cache, slots = batch.cache, batch.meta.slot_mapping
    every_byte = torch.arange(256, dtype=torch.uint8).view(4, 64)
    pages, offsets = slots // cache.page_size, slots % cache.page_size
    cache.value.view(torch.uint8)[pages, offsets, 0] = every_byte
    cache.value_scale[pages, offsets, 0] = scale
    out = backend.attention(batch.query, cache, batch.meta, 0.125)
    expected = every_byte.view(FP8_DTYPE).float() * torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(out[:, 0].isnan(), expected.isnan())
    assert torch.equal(out[:, 0].nan_to_num(), expected.nan_to_num())


def e4m3_sweep() -> torch.Tensor:
    """Every finite e4m3 value, both signs, and the points where rounding decides: each tie
    between neighbours (subnormals included) and a float32 step either side of it."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[values.isfinite()].unique()  # sorted; +0 and -0 are one value
    ties = (values[1:] + values[:-1]) / 2
    nudged = torch.cat([ties.nextafter(values[-1:].expand_as(ties)),
                        ties.nextafter(values[:1].expand_as(ties))])  # fmt: skip
    return torch.cat([values, ties, nudged, torch.tensor([2.0**-10, -(2.0**-10), 2.0**-12])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_fp8_store_quantises_exactly_as_the_twin(backend, dtype) -> None:
    """Byte for byte, scales included: views of a fused projection, outlier channels, an
    all-zero vector, and a sweep of e4m3's rounding points (vectors whose largest value is 448,
    so their scale is exactly 1 and the sweep reaches the encoder unscaled)."""
    sweep = e4m3_sweep()
    rows_of_sweep = -(-sweep.shape[0] // 63)
    batch = make_batch(
        [rows_of_sweep + 3, 1],
        [rows_of_sweep + 40, 17],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        dtype=dtype,
        kv_dtype=FP8_DTYPE,
    )
    num_tokens = batch.meta.slot_mapping.shape[0]
    fused = torch.randn(num_tokens, 3, 2, 64)
    fused[:, :, :, [5, 33]] *= 40
    fused[0, 1] = 0.0
    padded = torch.cat([sweep, torch.zeros(rows_of_sweep * 63 - sweep.shape[0])])
    fused[1 : 1 + rows_of_sweep, 1, 0, 1:] = padded.view(rows_of_sweep, 63)
    fused[1 : 1 + rows_of_sweep, 1, 0, 0] = 448.0
    if dtype == torch.bfloat16:
        fused = fused.to(dtype)  # the sweep then tests bf16's values near each rounding point
    key, value = fused[:, 1], fused[:, 2]
    expected = batch.pool.clone()
    store_kv_twin(key, value, expected.layer(1), batch.meta.slot_mapping)
    backend.store_kv(key, value, batch.cache, batch.meta.slot_mapping)
    assert torch.equal(batch.pool.pages.view(torch.uint8), expected.pages.view(torch.uint8))
    # Bits, not values: the pool's unwritten scales are NaN.
    assert torch.equal(batch.pool.scales.view(torch.int32), expected.scales.view(torch.int32))
    # The sweep reached the encoder with a scale of one and landed on every finite code.
    assert (batch.cache.key_scale == 1.0).any()
    stored = batch.cache.key.view(torch.uint8).flatten().unique()
    assert stored.numel() >= 254
