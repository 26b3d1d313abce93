"""Tile sizes and launch shapes of the Triton attention kernels, per GPU generation.

Each kernel takes its tiles from here: what ``python -m benchmarks.step.triton_kernels --tune``
measured fastest on a generation of GPU (``TUNED``), else the defaults below. A table rather than
``triton.autotune`` at run time, for three reasons: tuning would run inside the first requests
(seconds of compiling and timing each shape's candidates) and cannot run inside a CUDA graph
capture; two workers could pick different tiles for the same shape, and then a prefill worker
and a decode worker would round the same sums differently; and deterministic inference fixes
every sum's order by the key tile, so its tiles must not move between runs.

The candidate sets are what the tuner sweeps; every candidate is exact (the kernel tests run
each of them against the torch twin).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # (token, query head) rows per program, before rounding up to the GQA group
    block_n: int  # keys per step of the online softmax
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int  # keys per step of the online softmax
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"n{self.block_n} w{self.num_warps} s{self.num_stages}"


# The defaults, for heads of up to 128: a 128-row query tile keeps the tensor cores busy and its
# float32 accumulator in registers; decode is bound by memory, and a 64-key tile of 2-byte pages
# keeps enough bytes in flight (its key count follows the page's bytes: ``_by_bytes``). Other head
# sizes adjust them (``_fit_prefill``, ``_fit_decode``).
# num_stages: the kernels' K/V loads run num_stages - 1 tiles ahead of the math, but with 2 the
# next tile's loads are issued only after this tile's math (compiled for sm_90, nothing is left
# in flight across it: ``benchmarks.step.compiled_kernels``); 3 keeps a tile in flight behind it.
# Each stage costs shared memory (this default takes 96 KiB at 2 stages and 128 KiB at 3, past an
# sm_89 GPU's 99 KiB a program), so the default stays at 2 and the tuner chooses per generation.
DEFAULT_PREFILL = PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=2)
DEFAULT_DECODE = DecodeTiles(block_n=64, num_warps=4, num_stages=2)

PREFILL_CANDIDATES = (
    DEFAULT_PREFILL,
    PrefillTiles(128, 64, 8, 3),
    PrefillTiles(128, 128, 8, 2),
    PrefillTiles(128, 128, 8, 3),
    PrefillTiles(128, 32, 4, 3),
    PrefillTiles(64, 64, 4, 3),
    PrefillTiles(64, 128, 4, 2),
    PrefillTiles(64, 32, 4, 2),
)
# FP8 pages hold half a bf16 page's bytes: a key tile twice as long keeps as many in flight.
DECODE_CANDIDATES = (
    DEFAULT_DECODE,
    DecodeTiles(64, 4, 3),
    DecodeTiles(128, 4, 2),
    DecodeTiles(128, 8, 2),
    DecodeTiles(128, 4, 3),
    DecodeTiles(32, 4, 2),
    DecodeTiles(256, 8, 2),
)

# (compute capability, KV_QUANT flag) -> the tuner's choice for heads of up to 128. Empty until a
# tuning run on that generation is recorded here, with the figures that chose it.
TUNED_PREFILL: dict[tuple[tuple[int, int], str], PrefillTiles] = {}
TUNED_DECODE: dict[tuple[tuple[int, int], str], DecodeTiles] = {}


# Each attention launch looks its tiles up: the answers are kept (6 us a lookup on the host).
@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None  # Triton's interpreter
    return torch.cuda.get_device_capability(device)


def _fit_prefill(tiles: PrefillTiles, head_block: int) -> PrefillTiles:
    """Heads of 256 hold twice the registers per row: halve both tiles. Heads of 64 or less
    give each warp too little of a 128-row tile's work for 8 warps: 4 at most."""
    if head_block > 128:
        return replace(
            tiles, block_m=max(64, tiles.block_m // 2), block_n=max(32, tiles.block_n // 2)
        )
    if head_block < 128:
        return replace(tiles, num_warps=min(4, tiles.num_warps))
    return tiles


def _by_bytes(tiles: DecodeTiles, page_bytes: int) -> DecodeTiles:
    """Decode streams its pages, so a key tile is as long as its bytes allow: the default's 64
    keys of 2-byte pages become 128 keys of 8-bit pages (FP8, int8) and 32 of float32 ones. A
    tile of 8-bit pages as long as a bf16 one in keys would keep half the bytes in flight."""
    return replace(tiles, block_n=max(16, tiles.block_n * 2 // page_bytes))


def _fit_decode(tiles: DecodeTiles, head_block: int) -> DecodeTiles:
    """Heads of 256: half the keys per step, for the registers."""
    if head_block > 128:
        return replace(tiles, block_n=max(32, tiles.block_n // 2))
    return tiles


def prefill_tiles(device: torch.device, head_block: int, kv_quant: str) -> PrefillTiles:
    return prefill_tiles_for(_capability(device), head_block, kv_quant)


def decode_tiles(
    device: torch.device, head_block: int, kv_quant: str, page_bytes: int
) -> DecodeTiles:
    return decode_tiles_for(_capability(device), head_block, kv_quant, page_bytes)


@functools.cache
def prefill_tiles_for(
    capability: tuple[int, int] | None, head_block: int, kv_quant: str
) -> PrefillTiles:
    """The prefill tiles of a GPU generation (None: the interpreter's, the defaults)."""
    tuned = TUNED_PREFILL.get((capability, kv_quant), DEFAULT_PREFILL)
    return _fit_prefill(tuned, head_block)


@functools.cache
def decode_tiles_for(
    capability: tuple[int, int] | None, head_block: int, kv_quant: str, page_bytes: int
) -> DecodeTiles:
    """The decode tiles of a GPU generation (None: the interpreter's, the defaults) for pages of
    ``page_bytes`` per element. A tuned entry was measured on its own kind of page and is kept
    as it is; the default is sized by bytes."""
    tuned = TUNED_DECODE.get((capability, kv_quant))
    if tuned is None:
        tuned = _by_bytes(DEFAULT_DECODE, page_bytes)
    return _fit_decode(tuned, head_block)
