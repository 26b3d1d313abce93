"""The paged KV pool: one block-major tensor, so a page is one contiguous span across all layers.

``data`` has shape ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; a
layer's keys are ``data[:, layer, 0]``, a strided view the kernels read through its strides.
Quantised pools carry a second block-major tensor of scales, ``(num_blocks, num_layers, 2,
block_size, num_kv_heads)``, that travels with the pages: float32 for FP8 pages, one-byte codes
for int8 pages (``kernels/interface.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch

from kernels.interface import FP8_DTYPE, INT8_DTYPE, INT8_SCALE_DTYPE, KVCacheView

_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    FP8_DTYPE: "float8_e4m3fn",
    # int8 pages hold keys and values turned by a Hadamard transform (``kernels/kv_turn.py``):
    # the name is the scheme, so two workers agree on the turn when they agree on the dtype.
    INT8_DTYPE: "int8_hadamard",
}
_SCALE_DTYPES = {FP8_DTYPE: torch.float32, INT8_DTYPE: INT8_SCALE_DTYPE}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything two workers must agree on before pages can move between their pools."""

    dtype: str  # a key of _DTYPES_BY_NAME
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def create(
        cls,
        dtype: torch.dtype,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> KVLayout:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV cache dtype {dtype}")
        return cls(_DTYPE_NAMES[dtype], block_size, num_layers, num_kv_heads, head_dim)

    @classmethod
    def from_dict(cls, raw: dict) -> KVLayout:
        try:
            layout = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"malformed KV layout {raw!r}: {exc}") from exc
        if layout.dtype not in _DTYPES_BY_NAME:
            raise ValueError(f"unsupported KV cache dtype {layout.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(layout, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KV layout field {name} must be a positive int, got {value!r}")
        return layout

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES_BY_NAME[self.dtype]

    @property
    def is_fp8(self) -> bool:
        return self.torch_dtype == FP8_DTYPE

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """The dtype of the pages' scales, or None for pools that keep none."""
        return _SCALE_DTYPES.get(self.torch_dtype)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of KV data (scales excluded)."""
        elements = 1
        for size in self.page_shape:
            elements *= size
        return elements * self.torch_dtype.itemsize

    @property
    def scale_page_nbytes(self) -> int:
        if self.scale_dtype is None:
            return 0
        elements = 1
        for size in self.scale_page_shape:
            elements *= size
        return elements * self.scale_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one page costs in memory, scales included: what sizes the pool."""
        return self.page_nbytes + self.scale_page_nbytes

    def describe(self, model_dtype: torch.dtype) -> str:
        """The page scheme in words, with the tokens it holds per byte against ``model_dtype``
        pages: what start-up logs report."""
        plain = dataclasses.replace(self, dtype=_DTYPE_NAMES[model_dtype]).bytes_per_block
        capacity = f"{plain / self.bytes_per_block:.2f}x the tokens of {_DTYPE_NAMES[model_dtype]}"
        if self.torch_dtype == INT8_DTYPE:
            return f"int8 after a Hadamard turn, a one-byte scale per token and head, {capacity}"
        if self.is_fp8:
            return f"FP8 e4m3, a float32 scale per token and head, {capacity}"
        return self.dtype

    def mismatch(self, other: KVLayout) -> str | None:
        """A human-readable description of how ``other`` differs, or None if compatible."""
        diffs = [
            f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) or None


class KVPool:
    """Owns the pool tensors. Who may write which page is the block manager's business."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.data = torch.zeros(
            (num_blocks, *layout.page_shape), dtype=layout.torch_dtype, device=self.device
        )
        self.scales = (
            torch.ones(
                (num_blocks, *layout.scale_page_shape), dtype=layout.scale_dtype, device=device
            )
            if layout.scale_dtype is not None
            else None
        )

    def layer_view(self, layer: int) -> KVCacheView:
        if self.scales is None:
            return KVCacheView(self.data[:, layer, 0], self.data[:, layer, 1])
        return KVCacheView(
            self.data[:, layer, 0],
            self.data[:, layer, 1],
            self.scales[:, layer, 0],
            self.scales[:, layer, 1],
        )

    def page_bytes(self, block_id: int) -> torch.Tensor:
        """One page's KV data as a flat uint8 view (no copy)."""
        return self.data[block_id].view(-1).view(torch.uint8)

    def scale_bytes(self, block_id: int) -> torch.Tensor | None:
        """One page's scales as a flat uint8 view, or None for pools without scales."""
        if self.scales is None:
            return None
        return self.scales[block_id].view(-1).view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block
