"""The CPU attention backend: a C kernel for short query runs, SDPA for long prefill chunks.

Decode steps and speculative verification (a few query rows per sequence) spend almost nothing
on arithmetic and everything on overhead when they go through gathered pages and SDPA, so they
go to ``kernels/cpu/paged_attention.c``, which reads the pages in place. Prefill chunks are
compute-bound and go to SDPA's blocked kernel over their gathered context, as in the torch backend;
a chunk after a cached prefix in two calls, prefix and chunk, so that SDPA skips the masked half
of the chunk's own keys (``kernels/cpu/chunk_attention.py``).
Which sequence takes which path is decided once per step in ``plan``.

Deterministic inference sends every run to the C kernel: it sums in an order fixed by absolute
positions alone, so a token attends to the same bits as a decode step, inside a prefill chunk of
any length, or after a cached prefix. SDPA blocks its sums by the chunk's shape.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import torch

from kernels.cpu import library as cpu_library
from kernels.cpu.chunk_attention import (
    WholePrompts,
    chunk_attention_after_prefix,
    whole_prompts,
    whole_prompts_attention,
)
from kernels.cpu.features import has_amx_bf16
from kernels.interface import (
    FP8_DTYPE,
    INT8_DTYPE,
    SCALE_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    KVCacheView,
    check_window,
)
from kernels.torch_backend import store_kv as torch_store_kv

# Sequences with at most this many query rows in a step attend in the C kernel. It reads every
# key once per (sequence, KV head) and keeps a score row per query vector, which beats SDPA
# until a chunk is long enough for blocked matrix products to pay.
SHORT_QUERY_MAX = 16

KV_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    FP8_DTYPE: 3,
    INT8_DTYPE: 4,
}
# Query and output dtypes the kernel reads and writes itself; others go through float32.
_IO_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class CpuAttentionPlan(AttentionMetadata):
    """The step's metadata plus how its sequences split between the two paths."""

    short_seq_ids: torch.Tensor  # [num_short] int32, sequences for the C kernel
    long_chunks: tuple[tuple[int, int, int, int], ...]  # (seq, first row, end row, seq_len)
    # Runs of long chunks that attend as one batch (whole prompts of one length), and the
    # sequences they hold; the other long chunks attend one by one.
    prompt_batches: tuple[WholePrompts, ...]
    batched_seqs: frozenset[int]
    # The C kernel's per-step arguments (pointers into the int32 tensors below), built once.
    step_args: tuple
    int32_tensors: tuple[torch.Tensor, ...]


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, deterministic: bool = False) -> None:
        self._library = cpu_library.load()
        self._widen_long_chunks = _float32_sdpa_is_faster()
        # Long chunks of bf16 queries over bf16 pages attend on AMX tiles where the processor
        # has them (kernels/cpu/prefill_attention.c), decided by its flags as every process of
        # a machine decides alike: the kernel rounds its own way.
        self.prefill_on_amx = bool(self._library.pdserve_prefill_attention_available())
        self.deterministic = deterministic
        # The longest run of query rows the C kernel takes; longer ones go to SDPA.
        self._short_query_max = sys.maxsize if deterministic else SHORT_QUERY_MAX

    def plan(self, meta: AttentionMetadata) -> CpuAttentionPlan:
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        short: list[int] = []
        long_chunks: list[tuple[int, int, int, int]] = []
        for seq, (start, end) in enumerate(itertools.pairwise(starts)):
            if end - start <= self._short_query_max:
                short.append(seq)
            else:
                long_chunks.append((seq, start, end, seq_lens[seq]))
        tables, query_start_loc, lens = (
            _int32(meta.page_tables),
            _int32(meta.query_start_loc),
            _int32(meta.seq_lens),
        )
        short_ids = torch.tensor(short, dtype=torch.int32)
        step_args = (
            tables.data_ptr(),
            tables.stride(0),
            query_start_loc.data_ptr(),
            lens.data_ptr(),
            short_ids.data_ptr(),
            len(short),
        )
        fields = {name: getattr(meta, name) for name in AttentionMetadata.__dataclass_fields__}
        batches = whole_prompts(tuple(long_chunks), meta.page_tables)
        return CpuAttentionPlan(
            **fields,
            short_seq_ids=short_ids,
            long_chunks=tuple(long_chunks),
            prompt_batches=batches,
            batched_seqs=frozenset(seq for batch in batches for seq in batch.seqs),
            step_args=step_args,
            int32_tensors=(tables, query_start_loc, lens),
        )

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        pages = cache.key
        if not _rows_fit_the_c_store(key, value, cache, slot_mapping):
            torch_store_kv(key, value, cache, slot_mapping)
            return
        if cache.is_quantized:
            self._store_quantized(key, value, cache, slot_mapping)
            return
        self._library.pdserve_store_kv(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            pages.data_ptr(),
            cache.value.data_ptr(),
            pages.stride(0),
            pages.stride(1),
            pages.stride(2),
            pages.element_size(),
            cache.page_size,
            slot_mapping.data_ptr(),
            key.shape[0],
            key.shape[1],
            key.shape[2],
        )

    def _store_quantized(self, key, value, cache: KVCacheView, slot_mapping) -> None:
        """Quantise in C, bit for bit as ``kernels/kv_formats.py``'s ``quantize_fp8`` /
        ``quantize_int8``: a decode step's store in torch would take a dozen small ops per layer."""
        assert cache.key_scale is not None and cache.value_scale is not None
        pages, scales = cache.key, cache.key_scale
        store = (
            self._library.pdserve_store_kv_fp8
            if cache.is_fp8
            else self._library.pdserve_store_kv_int8
        )
        status = store(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            KV_DTYPE_CODES[key.dtype],
            pages.data_ptr(),
            cache.value.data_ptr(),
            *pages.stride()[:3],
            scales.data_ptr(),
            cache.value_scale.data_ptr(),
            *scales.stride(),
            cache.page_size,
            slot_mapping.data_ptr(),
            slot_mapping.shape[0],
            key.shape[1],
            key.shape[2],
        )
        if status != 0:
            raise ValueError(f"head_dim {key.shape[2]} is beyond the C store's row buffer")

    def attention(
        self,
        query: torch.Tensor,  # [N, num_heads, head_dim]
        cache: KVCacheView,
        meta: AttentionMetadata,
        softmax_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [N, num_heads, head_dim]
        check_window(window)
        plan = meta if isinstance(meta, CpuAttentionPlan) else self.plan(meta)
        io_dtype = query.dtype if query.dtype in _IO_DTYPE_CODES else torch.float32
        out = torch.empty(query.shape, dtype=io_dtype)
        if len(plan.short_seq_ids):
            self._attend_short(query.to(io_dtype), cache, plan, softmax_scale, window, out)
        # The AMX kernel attends every earlier key: a sliding-window layer's long chunks go
        # to SDPA over the pages of their window.
        if plan.long_chunks and window is None and self._amx_takes(query, cache):
            self._attend_long_on_amx(query, cache, plan, softmax_scale, out)
            return out
        for batch in plan.prompt_batches:
            rows = slice(batch.first_row, batch.end_row)
            out[rows] = whole_prompts_attention(
                self._long_rows(query, rows), cache, batch, softmax_scale, window
            )
        for seq, start, end, seq_len in plan.long_chunks:
            if seq in plan.batched_seqs:
                continue
            out[start:end] = chunk_attention_after_prefix(
                self._long_rows(query, slice(start, end)),
                cache,
                plan.page_tables[seq],
                seq_len,
                softmax_scale,
                window,
            )
        return out.to(query.dtype)

    def _amx_takes(self, query: torch.Tensor, cache: KVCacheView) -> bool:
        """Whether the AMX prefill kernel attends this step's long chunks: bf16 queries over bf16
        pages of one layout, in the head shapes it takes."""
        key, value = cache.key, cache.value
        return (
            self.prefill_on_amx
            and query.dtype == torch.bfloat16
            and key.dtype == torch.bfloat16
            and key.stride(-1) == 1
            and key.stride() == value.stride()
            and bool(
                self._library.pdserve_prefill_attention_fits(
                    query.shape[1], key.shape[2], query.shape[2]
                )
            )
        )

    def _attend_long_on_amx(
        self,
        query: torch.Tensor,  # [N, num_heads, head_dim] bf16
        cache: KVCacheView,
        plan: CpuAttentionPlan,
        softmax_scale: float,
        out: torch.Tensor,  # [N, num_heads, head_dim] bf16, contiguous
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        query = _heads_packed(query)
        key, value = cache.key, cache.value
        tables = plan.int32_tensors[0]
        row_bytes = tables.stride(0) * tables.element_size()
        for seq, start, end, seq_len in plan.long_chunks:
            status = self._library.pdserve_prefill_attention_bf16(
                query[start].data_ptr(),
                query.stride(0),
                out[start].data_ptr(),
                out.stride(0),
                key.data_ptr(),
                value.data_ptr(),
                *key.stride()[:3],
                cache.page_size,
                tables.data_ptr() + seq * row_bytes,
                end - start,
                seq_len,
                num_heads,
                key.shape[2],
                head_dim,
                softmax_scale,
                torch.get_num_threads(),
            )
            if status == -2:
                raise MemoryError("the AMX prefill attention could not allocate its scratch")
            if status != 0:
                raise ValueError(f"the AMX prefill attention refused a chunk (status {status})")

    def _long_rows(self, query: torch.Tensor, rows: slice) -> torch.Tensor:
        """Query rows for SDPA, widened to float32 where that is its faster path (the context
        is then gathered in float32 as well)."""
        chunk = query[rows]
        if self._widen_long_chunks and chunk.dtype == torch.bfloat16:
            return chunk.float()
        return chunk

    def _attend_short(
        self,
        query: torch.Tensor,  # [N, num_heads, head_dim], float32 or bf16
        cache: KVCacheView,
        plan: CpuAttentionPlan,
        softmax_scale: float,
        window: int | None,
        out: torch.Tensor,  # [N, num_heads, head_dim], query's dtype
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        query = _heads_packed(query)
        key, value = cache.key, cache.value
        if key.stride(-1) != 1 or key.stride() != value.stride():
            raise ValueError("the CPU kernel needs key and value pages of one layout, unit stride")
        scale_strides = (0, 0, 0)
        if cache.is_quantized:
            key_scale, value_scale = cache.key_scale, cache.value_scale
            assert key_scale is not None and value_scale is not None
            # The kernel reads both scales through one set of strides, as codes or as floats.
            scale_dtype = SCALE_DTYPES[key.dtype]
            if (
                key_scale.dtype != scale_dtype
                or value_scale.dtype != scale_dtype
                or key_scale.stride() != value_scale.stride()
            ):
                raise ValueError(
                    f"the CPU kernel needs {scale_dtype} key and value scales of one layout"
                )
            scale_strides = key_scale.stride()
        status = self._library.pdserve_paged_attention(
            query.data_ptr(),
            query.stride(0),
            out.data_ptr(),
            out.stride(0),
            key.data_ptr(),
            value.data_ptr(),
            _pointer(cache.key_scale),
            _pointer(cache.value_scale),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            *scale_strides,
            KV_DTYPE_CODES[key.dtype],
            cache.page_size,
            *plan.step_args,
            num_heads,
            key.shape[2],
            head_dim,
            softmax_scale,
            window or 0,  # the kernel's "none"
            _IO_DTYPE_CODES[query.dtype],
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")


def _float32_sdpa_is_faster() -> bool:
    """Whether SDPA runs a bf16 prefill chunk faster widened to float32: on processors without
    native bf16 matrix units (AMX) its bf16 path is the slower one (61 vs 36 ms for 1,800 tokens
    and 9 heads on a Xeon without AMX). Decided by the processor's flags, not by timing it: the
    two paths round differently, and every process on a machine must choose alike to give the
    same tokens."""
    return not has_amx_bf16()


def _heads_packed(query: torch.Tensor) -> torch.Tensor:
    """``query [N, num_heads, head_dim]`` with each row's head vectors packed one after another,
    as the C kernels read a row (rows themselves may be any stride apart); copied only if not."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        return query.contiguous()
    return query


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.int32 and tensor.is_contiguous():
        return tensor
    return tensor.to(torch.int32).contiguous()


def _rows_fit_the_c_store(key, value, cache: KVCacheView, slot_mapping) -> bool:
    """Whether the C stores take these rows: unit-stride head vectors packed in a row, int64
    slots, key and value pages (and scales) with one set of strides, rows of float32 or bf16
    for quantised pages, of the pages' own dtype for 16- and 32-bit ones."""
    pages = cache.key
    if cache.is_quantized:
        assert cache.key_scale is not None and cache.value_scale is not None
        dtypes_fit = key.dtype in _IO_DTYPE_CODES and value.dtype == key.dtype
        dtypes_fit = dtypes_fit and cache.key_scale.stride() == cache.value_scale.stride()
    else:
        dtypes_fit = key.dtype == pages.dtype == value.dtype
    return (
        dtypes_fit
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key.stride(1) == key.shape[2]
        and value.stride(1) == value.shape[2]
        and pages.stride() == cache.value.stride()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
    )
