"""The attention backend contract shared by the torch, C and Triton backends.

The model runner calls, for every layer of one forward:

1. ``store_kv`` to write the step's new keys and values into their pages (or
   ``rotate_and_store_kv``, which first rotates the queries and keys by RoPE), then
2. ``attention`` to attend every new query token over its sequence's whole context, which is
   read back from the pages (so the tokens of this step are seen exactly as later steps will see
   them, FP8 rounding included).

A forward is a flattened batch of ``N`` new tokens from ``S`` sequences. Sequence ``i`` owns
query rows ``query_start_loc[i]:query_start_loc[i + 1]``; with ``q`` new tokens and ``L =
seq_lens[i]`` tokens of context after this step, its query row ``j`` sits at position
``L - q + j`` and attends causally to positions ``0 .. L - q + j``. A decode token is simply a
sequence with ``q == 1``; a prefill chunk over a cached prefix is one with ``q < L``.

A sliding-window layer passes its ``window``: a row at position ``p`` then attends to positions
``p - window < j <= p`` only (``transformers``' convention, ``common/context_window.py``), and
the backends read no page that holds none of those positions. Such pages may already be back in
the pool (``Sequence.num_released_pages``): their page-table entries are stale and never read.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Keeps an all-zero token's scale positive, so dequantisation never divides by zero.
FP8_MIN_SCALE = 1e-12

# int8 pages hold keys and values after a Hadamard turn of head_dim (``kernels/kv_turn.py``),
# rounded to the nearest integer step of their (token, head) vector's scale. The scale is one
# byte: an unsigned float with 5 exponent and 3 mantissa bits, ``(1 + m/8) * 2**(e - 20)``, so
# its float32 bits are ``(code << 20) + INT8_SCALE_BITS_BASE`` in every backend, no table and no
# exp2 to round differently. Scales run from 2**-20 to 1.875 * 2**11.
INT8_DTYPE = torch.int8
INT8_MAX = 127.0
INT8_SCALE_DTYPE = torch.uint8
INT8_SCALE_BITS_BASE = (127 - 20) << 23
# The dtype each 8-bit page format keeps its scales in.
SCALE_DTYPES = {FP8_DTYPE: torch.float32, INT8_DTYPE: INT8_SCALE_DTYPE}


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token of one forward sits: built by the runner, read by the backends."""

    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, context length of each sequence after this step
    page_tables: torch.Tensor  # [S, max_pages_per_seq] int32, page ids in context order
    slot_mapping: torch.Tensor  # [N] int64, page_id * page_size + offset of each new token
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


# eq=False: a view is itself, compared and hashed by identity (its tensors have no equality to
# compare by), so a backend may keep what it works out from a view beside it.
@dataclass(frozen=True, eq=False)
class KVCacheView:
    """One layer's view of the page-major pool; every tensor is a strided view, never a copy.

    ``key_scale``/``value_scale`` are set only for quantised pools, one scale per token and KV
    head, so ``dequant(x) = x.float() * scale[..., None]``: float32 for FP8 pools, the one-byte
    code of ``INT8_SCALE_BITS_BASE`` for int8 pools.
    """

    key: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    key_scale: torch.Tensor | None = None  # [num_pages, page_size, num_kv_heads]
    value_scale: torch.Tensor | None = None  # [num_pages, page_size, num_kv_heads]

    @property
    def page_size(self) -> int:
        return self.key.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == FP8_DTYPE

    @property
    def is_int8(self) -> bool:
        return self.key.dtype == INT8_DTYPE

    @property
    def is_quantized(self) -> bool:
        return self.is_fp8 or self.is_int8


def check_window(window: int | None) -> None:
    """``ValueError`` unless ``window`` is None or a positive number of positions."""
    if window is not None and (isinstance(window, bool) or window < 1):
        raise ValueError(f"a sliding window must be a positive number of positions, got {window}")


def window_start(position: int, window: int | None) -> int:
    """The first position a query at ``position`` attends to."""
    return 0 if window is None else max(0, position - window + 1)


class AttentionBackend(ABC):
    """Paged attention over the page-major KV pool. Implementations hold no per-step state:
    what a backend derives from a step's metadata lives in the plan it returns."""

    name: str

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Per-step work, done once before the first layer (splitting the batch by kind of row,
        host-side lists, index tensors). The model calls it once per forward and hands
        the result to every layer's ``attention`` in place of ``meta``; it is ``meta`` or a
        subclass of it that carries the derived fields. The default derives nothing."""
        return meta

    def launching_every_variant(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``attention`` also launches each compiled variant of its kernels that it
        could choose for the batch's kind (decode or prefill) and shapes: the start-up's forward
        runs under it, so that none is compiled later, in front of a request. A backend whose
        kernels are not compiled on first use has nothing to launch."""
        return contextlib.nullcontext()

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,  # [N, num_kv_heads, head_dim]
        value: torch.Tensor,  # [N, num_kv_heads, head_dim]
        cache: KVCacheView,
        slot_mapping: torch.Tensor,  # [N] int64
    ) -> None:
        """Write token ``n``'s key and value into slot ``slot_mapping[n]`` of ``cache``.

        For FP8 caches each (token, head) vector is scaled by ``amax / 448`` before the cast and
        the scale is written beside it; int8 caches take the smallest one-byte scale of at least
        ``amax / 127`` and round to nearest (``kernels/kv_formats.py``). Only the given slots
        are modified.
        """

    def rotate_and_store_kv(
        self,
        rotary: nn.Module,  # the layer's RoPE: (q, k, cos, sin) -> (q, k)
        query: torch.Tensor,  # [N, num_heads, head_dim]
        key: torch.Tensor,  # [N, num_kv_heads, head_dim]
        value: torch.Tensor,  # [N, num_kv_heads, head_dim]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [N, head_dim]
        cache: KVCacheView,
        slot_mapping: torch.Tensor,  # [N] int64
    ) -> torch.Tensor:  # the rotated query
        """``rotary`` on the queries and keys, then ``store_kv`` of the rotated keys and the
        values. A backend with a kernel that gives ``rotary``'s bits may do all of it in one
        pass; the rotated keys are then only in the pages, where ``attention`` reads them."""
        query, key = rotary(query, key, *rope)
        self.store_kv(key, value, cache, slot_mapping)
        return query

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,  # [N, num_heads, head_dim]
        cache: KVCacheView,
        meta: AttentionMetadata,
        softmax_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [N, num_heads, head_dim], query's dtype
        """Causal attention of every new token over its sequence's context in ``cache``, or
        over the last ``window`` positions up to its own (a sliding-window layer).

        ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention). The
        step's own keys and values must already be stored. Does not modify the cache.
        """
