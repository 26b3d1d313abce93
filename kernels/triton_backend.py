"""The Triton attention backend: the KV store, decode and chunked-prefill kernels behind one API."""

from __future__ import annotations

import torch

from kernels.interface import AttentionBackend, AttentionMetadata, KVCacheView
from kernels.triton_decode_attention import decode_attention
from kernels.triton_prefill_attention import prefill_attention
from kernels.triton_store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    """Dispatches on the batch's shape, known on the host without a sync.

    A batch of pure decode steps (one query per sequence) goes to the split-K decode kernel;
    anything else, including decode steps mixed with prefill chunks, to the prefill kernel.
    """

    name = "triton"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCacheView,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(key, value, cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        cache: KVCacheView,
        meta: AttentionMetadata,
        softmax_scale: float,
    ) -> torch.Tensor:
        if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
            return decode_attention(query, cache, meta, softmax_scale)
        return prefill_attention(query, cache, meta, softmax_scale)
