"""Host tensors on 2 MB pages: the KV pool a CPU decode step reads at random.

A decode step reads each sequence's KV pages wherever the pool handed them out, so on 4 KB pages
nearly every page read misses the TLB (a pool of a few GB spans a million 4 KB pages; the TLB
holds a few thousand) and waits for a page walk. On 2 MB pages the walks all but vanish: on a
2-core AMX Xeon, decode attention over SmolLM2's pages ran 8-10% faster
(``python -m benchmarks.step.cpu_attention decode``), and a plain read of memory 40% faster.

Linux backs anonymous memory with 2 MB pages (transparent huge pages) only where a mapping
covers whole aligned 2 MB ranges, and, in the usual ``madvise`` mode, only where the process
asked for it before first touching the memory. ``zeros_on_huge_pages`` does both; where the
kernel cannot (another OS, huge pages turned off, a small tensor) it is ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or "never"
    where there is none to ask (not Linux, the file unreadable)."""
    if not sys.platform.startswith("linux"):
        return "never"
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "never"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen if chosen in ("always", "madvise") else "never"


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    function = ctypes.CDLL(name, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory starts on a 2 MB boundary and was marked for 2 MB pages
    before it was first touched (the zeroing then faults them in). Its storage is 2 MB larger
    than its data: the slack before the boundary and after the last whole page."""
    nbytes = math.prod(shape) * dtype.itemsize
    advise = _madvise()
    if huge_pages_mode() == "never" or advise is None or nbytes < 2 * HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    start = raw.data_ptr() + offset
    whole_pages = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if advise(start, whole_pages, _MADV_HUGEPAGE) != 0:
        # Refused (an old kernel, a seccomp filter): the memory still serves, on small pages.
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    tensor = raw[offset : offset + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s memory that the kernel backs with huge pages now, from the
    ``AnonHugePages`` of the mappings it lies in (0 where /proc/self/smaps cannot be read). The
    kernel merges neighbouring mappings of like flags, so a mapping may hold other tensors' huge
    pages too: each counts at most the bytes it shares with this tensor."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return sum(
        min(int(fields["AnonHugePages"].split()[0]) * 1024, min(end, high) - max(start, low))
        for low, high, fields in mappings(start, end)
    )


def mappings(start: int, end: int) -> list[tuple[int, int, dict[str, str]]]:
    """Each of this process's mappings that overlaps the addresses [start, end): its own range
    [low, high) and its /proc/self/smaps fields (name -> the rest of its line)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, int, dict[str, str]]] = []
    fields: dict[str, str] | None = None
    for line in lines:
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
            low, high = (int(bound, 16) for bound in head.split("-"))
            fields = {} if low < end and start < high else None
            if fields is not None:
                found.append((low, high, fields))
        elif fields is not None and head.endswith(":"):
            fields[head[:-1]] = rest.strip()
    return found
