"""Host tensors on 2 MB pages (kernels/cpu/huge_pages.py) and the CPU KV pool that takes them."""

from __future__ import annotations

import pytest
import torch

from common.engine.kv_pool import KVPool, kv_layout
from kernels.cpu.huge_pages import (
    HUGE_PAGE_BYTES,
    huge_page_bytes,
    huge_pages_mode,
    mappings,
    zeros_on_huge_pages,
)

needs_huge_pages = pytest.mark.skipif(
    huge_pages_mode() == "never", reason="this kernel backs no memory with huge pages"
)


def advised_for_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether every mapping under ``tensor``'s whole 2 MB pages carries madvise(MADV_HUGEPAGE)'s
    flag (the part of a last page short of 2 MB is not advised)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size() // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    found = mappings(start, end)
    return bool(found) and all("hg" in fields["VmFlags"].split() for _, _, fields in found)


@needs_huge_pages
def test_a_large_tensor_starts_on_a_huge_page_marked_for_huge_pages_and_is_zero() -> None:
    shape = (3, 5 * HUGE_PAGE_BYTES // 6 + 7)
    tensor = zeros_on_huge_pages(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert tensor.is_contiguous() and not tensor.any()
    if huge_pages_mode() == "madvise":
        assert advised_for_huge_pages(tensor)
    tensor[-1, -1] = 5.0  # all of it is writable, to its last element
    assert float(tensor.sum()) == 5.0
    # How much the kernel did back with huge pages depends on its free memory: it is only
    # reported, never more than the tensor's own bytes.
    assert 0 <= huge_page_bytes(tensor) <= tensor.numel() * 4


def test_huge_pages_of_a_mapping_merged_with_others_count_only_the_tensors_share(
    monkeypatch,
) -> None:
    """The kernel merges neighbouring advised mappings into one, whose AnonHugePages then
    covers other tensors too: a tensor is counted at most the bytes it shares with each."""
    tensor = torch.zeros(3 * HUGE_PAGE_BYTES // 4)
    start = tensor.data_ptr()
    end = start + 3 * HUGE_PAGE_BYTES
    merged = (start - 8 * HUGE_PAGE_BYTES, end + 8 * HUGE_PAGE_BYTES)
    monkeypatch.setattr(
        "kernels.cpu.huge_pages.mappings",
        lambda low, high: [(*merged, {"AnonHugePages": f"{19 * HUGE_PAGE_BYTES // 1024} kB"})],
    )
    assert huge_page_bytes(tensor) == 3 * HUGE_PAGE_BYTES
    part = (start + HUGE_PAGE_BYTES, end + HUGE_PAGE_BYTES)
    monkeypatch.setattr(
        "kernels.cpu.huge_pages.mappings",
        lambda low, high: [(*part, {"AnonHugePages": f"{HUGE_PAGE_BYTES // 1024} kB"})],
    )
    assert huge_page_bytes(tensor) == HUGE_PAGE_BYTES


def test_a_small_tensor_is_plain_zeros() -> None:
    tensor = zeros_on_huge_pages((4, 8), torch.bfloat16)
    assert tensor.shape == (4, 8) and tensor.dtype == torch.bfloat16 and not tensor.any()
    assert tensor.untyped_storage().nbytes() == 4 * 8 * 2


def test_without_huge_pages_the_tensor_is_plain_zeros(monkeypatch) -> None:
    monkeypatch.setattr("kernels.cpu.huge_pages.huge_pages_mode", lambda: "never")
    tensor = zeros_on_huge_pages((1024, 1024), torch.float32)
    assert not tensor.any() and tensor.untyped_storage().nbytes() == 1024 * 1024 * 4


@needs_huge_pages
def test_the_cpu_kv_pool_lies_on_huge_pages() -> None:
    layout = kv_layout(torch.bfloat16, page_size=16, num_layers=4, num_kv_heads=2, head_dim=64)
    pool = KVPool(layout, 512, "cpu")  # 16 MB
    assert pool.data.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.data.any()
    if huge_pages_mode() == "madvise":
        assert advised_for_huge_pages(pool.data)
