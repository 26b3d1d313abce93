"""The Triton attention backend: the KV store, decode and chunked-prefill kernels behind one API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kernels.interface import AttentionBackend, AttentionMetadata, KVCacheView
from kernels.triton.decode_attention import decode_attention, split_counts_to_compile
from kernels.triton.elementwise import CudaRotaryApply
from kernels.triton.prefill_attention import prefill_attention
from kernels.triton.store_kv import rotate_and_store_kv, store_kv


class TritonAttentionBackend(AttentionBackend):
    """Dispatches on the batch's shape, known on the host without a sync.

    A batch of pure decode steps (one query per sequence) goes to the split-K decode kernel;
    anything else, including decode steps mixed with prefill chunks, to the prefill kernel.

    ``deterministic``: every step goes to the prefill kernel, whose tiles of keys start at
    position 0 of the sequence in one fixed size; so a query row's sum runs over the same tiles
    in the same order whether it comes in a decode step, a chunk of any length or after a cached
    prefix, and keys past the row add exact zeros. (The decode kernel splits a context by the
    batch's size to fill the GPU, which moves the sum's order with the batch.)
    """

    name = "triton"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self._every_variant = False

    @contextlib.contextmanager
    def launching_every_variant(self) -> Iterator[None]:
        """The prefill kernel has one variant per model and page format; the decode kernel's
        split count picks among several (``split_counts_to_compile``), and a decode batch inside
        launches each of them over its own inputs."""
        self._every_variant = True
        try:
            yield
        finally:
            self._every_variant = False

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCacheView,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(key, value, cache, slot_mapping)

    def rotate_and_store_kv(
        self,
        rotary: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCacheView,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """One launch where the layer's RoPE is ``CudaRotaryApply``, whose bits the store kernel
        gives: on CUDA a layer's RoPE and store were three launches."""
        if isinstance(rotary, CudaRotaryApply):
            rotate_and_store_kv(query, key, value, *rope, cache, slot_mapping)
            return query
        return super().rotate_and_store_kv(rotary, query, key, value, rope, cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        cache: KVCacheView,
        meta: AttentionMetadata,
        softmax_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        decode_only = meta.max_query_len == 1 and query.shape[0] == meta.num_seqs
        if decode_only and not self.deterministic:
            if self._every_variant:
                for num_splits in split_counts_to_compile(cache.key.shape[2], query.device):
                    decode_attention(
                        query, cache, meta, softmax_scale, window, num_splits=num_splits
                    )
            return decode_attention(query, cache, meta, softmax_scale, window)
        return prefill_attention(query, cache, meta, softmax_scale, window)
