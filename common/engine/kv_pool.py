"""The paged KV pool: one page-major tensor, so a page is one contiguous span across all layers.

``data`` has shape ``(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)``; a
layer's keys are ``data[:, layer, 0]``, a strided view the kernels read through its strides.
Quantised pools carry a second page-major tensor of scales, ``(num_pages, num_layers, 2,
page_size, num_kv_heads)``, that travels with the pages: float32 for FP8 pages, one-byte codes
for int8 pages (``kernels/interface.py``).
"""

from __future__ import annotations

import torch

from common.kv_layout import FP8_E4M3, INT8_HADAMARD, KVLayout
from kernels.cpu.huge_pages import zeros_on_huge_pages
from kernels.interface import FP8_DTYPE, INT8_DTYPE, SCALE_DTYPES, KVCacheView

_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    FP8_DTYPE: FP8_E4M3,
    INT8_DTYPE: INT8_HADAMARD,
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def kv_layout(
    dtype: torch.dtype, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int
) -> KVLayout:
    """The layout of pages of torch ``dtype``."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV cache dtype {dtype}")
    layout = KVLayout(_DTYPE_NAMES[dtype], page_size, num_layers, num_kv_heads, head_dim)
    problem = layout.problem()
    if problem is not None:
        raise ValueError(problem)
    return layout


def dtype_name(dtype: torch.dtype) -> str:
    """The name a layout gives pages of torch ``dtype``."""
    return _DTYPE_NAMES[dtype]


def page_dtype(layout: KVLayout) -> torch.dtype:
    return _DTYPES_BY_NAME[layout.dtype]


def scale_dtype(layout: KVLayout) -> torch.dtype | None:
    """The dtype of the pages' scales, or None for pools that keep none."""
    return SCALE_DTYPES.get(page_dtype(layout))


class KVPool:
    """Owns the pool tensors. Who may write which page is the page manager's business."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_pages, *layout.page_shape)
        if self.device.type == "cpu":
            # A decode step reads its pages at random: on 2 MB pages it seldom waits for a
            # page walk (kernels/cpu/huge_pages.py).
            self.data = zeros_on_huge_pages(shape, page_dtype(layout))
        else:
            self.data = torch.zeros(shape, dtype=page_dtype(layout), device=self.device)
        scales = scale_dtype(layout)
        self.scales = (
            torch.ones((num_pages, *layout.scale_page_shape), dtype=scales, device=device)
            if scales is not None
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

    def page_bytes(self, page_id: int) -> torch.Tensor:
        """One page's KV data as a flat uint8 view (no copy)."""
        return self.data[page_id].view(-1).view(torch.uint8)

    def scale_bytes(self, page_id: int) -> torch.Tensor | None:
        """One page's scales as a flat uint8 view, or None for pools without scales."""
        if self.scales is None:
            return None
        return self.scales[page_id].view(-1).view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page
