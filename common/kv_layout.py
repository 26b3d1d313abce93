"""What two workers must agree on before KV pages can move between their pools.

A ``KVLayout`` travels in registrations and transfer handshakes, so it names its page dtype by a
string and knows its sizes without torch (the router imports it too). The torch side of a
layout (the tensors' dtypes) lives with the pool, in ``common/engine/kv_pool.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FP8_E4M3 = "float8_e4m3fn"
# int8 pages hold keys and values turned by a Hadamard transform (``kernels/kv_turn.py``): the
# name is the scheme, so two workers agree on the turn when they agree on the dtype.
INT8_HADAMARD = "int8_hadamard"
# Bytes per element of each page dtype, and of the scales quantised pages carry per token and
# head: float32 for FP8 (vLLM's format), a one-byte code for int8.
PAGE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, FP8_E4M3: 1, INT8_HADAMARD: 1}
SCALE_ITEMSIZE = {FP8_E4M3: 4, INT8_HADAMARD: 1}


def pages_for(num_tokens: int, page_size: int) -> int:
    """The pages that ``num_tokens`` tokens fill, the last one maybe in part."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The page format and shape; a pool's pages are ``(num_layers, 2, page_size, num_kv_heads,
    head_dim)`` elements of ``dtype``, plus ``(num_layers, 2, page_size, num_kv_heads)`` scales
    for quantised dtypes."""

    dtype: str  # a key of PAGE_ITEMSIZE
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Which of the model's KV heads the pool holds: ``num_kv_heads`` of them from this one. A
    # tensor-parallel rank's pool holds a slice (common/model/parallel.py); None: all of them.
    first_kv_head: int = 0
    model_kv_heads: int | None = None

    def problem(self) -> str | None:
        """Why this layout cannot be served, or None. Not checked on construction: a layout off
        the wire with a dtype this version does not know must still reach the handshake or the
        registration that refuses it, and say why."""
        if self.dtype not in PAGE_ITEMSIZE:
            return f"unsupported KV cache dtype {self.dtype!r}; known: {', '.join(PAGE_ITEMSIZE)}"
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                return f"KV layout field {name} must be a positive int, got {value!r}"
        total = self.model_kv_heads
        if self.first_kv_head < 0 or (
            total is not None and self.first_kv_head + self.num_kv_heads > total
        ):
            return f"KV layout holds {self.heads_held()}, which the model does not have"
        return None

    @property
    def holds_all_heads(self) -> bool:
        return self.model_kv_heads is None or self.num_kv_heads == self.model_kv_heads

    def heads_held(self) -> str:
        """Which KV heads the pool holds, in words: ``KV heads 2-3 of 4``."""
        last = self.first_kv_head + self.num_kv_heads - 1
        total = self.model_kv_heads if self.model_kv_heads is not None else self.num_kv_heads
        return f"KV heads {self.first_kv_head}-{last} of {total}"

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_E4M3

    @property
    def is_int8(self) -> bool:
        return self.dtype == INT8_HADAMARD

    @property
    def has_scales(self) -> bool:
        return self.dtype in SCALE_ITEMSIZE

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of KV data (scales excluded)."""
        return _product(self.page_shape) * PAGE_ITEMSIZE[self.dtype]

    @property
    def scale_page_nbytes(self) -> int:
        """Bytes of one page's scales; 0 for dtypes without scales."""
        return _product(self.scale_page_shape) * SCALE_ITEMSIZE.get(self.dtype, 0)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs in memory, scales included: what sizes the pool."""
        return self.page_nbytes + self.scale_page_nbytes

    def capacity_against(self, dtype: str) -> float:
        """How many times the tokens of ``dtype`` pages this layout holds in the same bytes."""
        plain = dataclasses.replace(self, dtype=dtype)
        return plain.bytes_per_page / self.bytes_per_page

    def describe(self, model_dtype: str) -> str:
        """The page scheme in words, with its capacity against ``model_dtype`` pages: what
        start-up logs report."""
        capacity = f"{self.capacity_against(model_dtype):.2f}x the tokens of {model_dtype}"
        if self.is_int8:
            return f"int8 after a Hadamard turn, a one-byte scale per token and head, {capacity}"
        if self.is_fp8:
            return f"FP8 e4m3, a float32 scale per token and head, {capacity}"
        return self.dtype

    @property
    def heads(self) -> range:
        """The model's KV heads this pool holds."""
        return range(self.first_kv_head, self.first_kv_head + self.num_kv_heads)

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads, all of them (a slice's pool knows them from model_kv_heads)."""
        return self.model_kv_heads if self.model_kv_heads is not None else self.num_kv_heads

    def slice_nbytes(self, num_heads: int) -> tuple[int, int]:
        """Bytes of one page's data and of its scales for ``num_heads`` of its heads: what a
        fetch of a head slice moves per page."""
        sliced = dataclasses.replace(self, num_kv_heads=num_heads)
        return sliced.page_nbytes, sliced.scale_page_nbytes

    def mismatch(self, other: KVLayout) -> str | None:
        """How ``other``'s pages differ from these in format (dtype, sizes, the model's KV
        heads), or None if heads can move between the two pools.

        Which heads each pool holds is not compared: a tensor-parallel rank's pool holds a
        slice, and each fetch names the heads it moves (``head_slice_problem``)."""
        diffs = [
            f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in ("dtype", "page_size", "num_layers", "head_dim", "total_kv_heads")
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) or None

    def head_slice_problem(self, heads: range, where: str) -> str | None:
        """Why the pool ``where`` cannot serve (or take) model KV heads ``heads``, or None."""
        if not heads or heads.step != 1:
            return f"an empty or strided head range {heads!r}"
        if heads.start < self.first_kv_head or heads.stop > self.heads.stop:
            return (
                f"KV heads {heads.start}-{heads.stop - 1} asked of the pool {where}, which "
                f"holds {self.heads_held()}"
            )
        return None


def _product(sizes: tuple[int, ...]) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total
