"""Which bf16 tile kernel this machine multiplies with, chosen once for every process on it.

The kernels round differently, so every process of a machine (workers, the deterministic mode)
must run the same one: the choice is timed once and kept beside the library (``publish_first``,
the first choice written winning). The library applies it at load (``kernels/cpu/library.py``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kernels.timing import first_is_faster

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Which kernel multiplies bf16 weight tiles (kernels/cpu/exports.h's bf16_tiles_kind): float32
# FMAs over widened weights, AVX512_BF16's vdpbf16ps, or AMX tiles.
BF16_TILES = {"fma": 0, "dpbf16": 1, "amx": 2}
# Names one of BF16_TILES to run instead of the machine's own choice (machine_bf16_tiles).
ENV_BF16_TILES = "PDSERVE_CPU_BF16_TILES"
# Where a processor has AVX512_BF16 and no AMX, vdpbf16ps and the FMAs are timed against each
# other once per machine. vdpbf16ps does two products a 32-bit lane where an FMA does one, but
# cores issue it at different rates: a Sapphire Rapids Xeon issues one a cycle against two FMAs
# (1.3-1.5x slower than the FMAs at 32 and 128 rows); a core that issues it as fast as an FMA
# does twice the work. Each weight: [out, in], 4 MB of bf16; together past any of these cores'
# L2, so the small row count reads them from memory as a decode step does. Both counts must go
# vdpbf16ps's way (a decode batch, and a prefill-sized block where the tiles are bound by
# arithmetic), else the FMAs, the kernel every machine runs, stay.
BF16_TILES_PROBE_SHAPE = (2048, 1024)
BF16_TILES_PROBE_WEIGHTS = 4
BF16_TILES_PROBE_ROWS = (8, 128)
# "1": decode attention scores bf16 queries over bf16 pages with vdpbf16ps where the processor
# has AVX512_BF16 (kernels/cpu/paged_attention.c), a rounding path of its own. Off by default:
# on a 2-core AMX Xeon it ran no faster than the widening FMAs (the pages' reads, not the
# products, bound decode attention there); for processors where bf16 pairs pay. Every process
# of a machine reads the same setting, so they round alike (the deterministic mode included).
ENV_BF16_PAIR_SCORES = "PDSERVE_CPU_BF16_PAIR_SCORES"


def pair_scores_wanted(library: ctypes.CDLL) -> bool:
    """Whether ``ENV_BF16_PAIR_SCORES`` asks for bf16 pair scores and this machine has them."""
    if os.environ.get(ENV_BF16_PAIR_SCORES, "") != "1":
        return False
    if library.pdserve_bf16_pair_scores_available():
        return True
    logger.error(
        "%s=1: this processor has no AVX512_BF16; scoring in float32", ENV_BF16_PAIR_SCORES
    )
    return False


def default_bf16_tiles(library: ctypes.CDLL, library_path: Path) -> str:
    """The bf16 tile kernel a process runs: ``ENV_BF16_TILES``'s where it names one this
    machine runs, else the machine's own (``machine_bf16_tiles``), kept beside the library
    file at ``library_path``, whose name already says the sources, flags and CPU it was timed
    with. Fixed at load, before anything packs tiles (their layout follows the kernel)."""
    wanted = os.environ.get(ENV_BF16_TILES, "")
    if wanted:
        if wanted in BF16_TILES and library.pdserve_bf16_tiles_available(BF16_TILES[wanted]):
            return wanted
        logger.error(
            "%s=%s: this machine runs bf16 tiles with %s only; taking the default",
            ENV_BF16_TILES,
            wanted,
            ", ".join(k for k, v in BF16_TILES.items() if library.pdserve_bf16_tiles_available(v)),
        )
    return machine_bf16_tiles(library, library_path.with_suffix(".bf16-tiles.json"))


def machine_bf16_tiles(library: ctypes.CDLL, store: Path) -> str:
    """AMX where there is AMX; else, where there is AVX512_BF16, whichever of vdpbf16ps and the
    FMAs this machine chose (``_probe_bf16_tiles``, on first use, kept at ``store``); else the
    FMAs. The kernels round differently, so every process on a machine, workers and the
    deterministic mode included, must run the same one: the first choice written is kept."""
    if library.pdserve_bf16_tiles_available(BF16_TILES["amx"]):
        return "amx"
    if not library.pdserve_bf16_tiles_available(BF16_TILES["dpbf16"]):
        return "fma"
    chosen = _read_bf16_tiles(store)
    if chosen is None:
        chosen = publish_first(
            store,
            _probe_bf16_tiles(library),
            lambda name: json.dumps({"kernel": name}),
            _read_bf16_tiles,
        )
        logger.info("bf16 tiles: this machine runs %s (timed against the other)", chosen)
    return chosen


def _read_bf16_tiles(store: Path) -> str | None:
    try:
        chosen = json.loads(store.read_text())["kernel"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return chosen if chosen in ("fma", "dpbf16") else None


def _probe_bf16_tiles(library: ctypes.CDLL) -> str:
    """Which bf16 tile kernel this machine runs: vdpbf16ps ("dpbf16") where it multiplies the
    probe's weights faster than the FMAs at every one of ``BF16_TILES_PROBE_ROWS``, else the
    FMAs ("fma"). One thread: which instruction a core runs faster does not depend on how many
    cores run it, and one thread is what ``first_is_faster`` can time on a busy machine. The
    weights' values do not matter to either kernel's speed, only their bytes (one layout's size
    is the other's: both dimensions are multiples of the tiles' 32 columns and of the pairs'
    block of k)."""
    # Imported here: the library loads without torch (the CLI asks it for the CPU's flags).
    import torch

    out_features, in_features = BF16_TILES_PROBE_SHAPE
    weights = [
        torch.randn(out_features, in_features).to(torch.bfloat16)
        for _ in range(BF16_TILES_PROBE_WEIGHTS)
    ]
    previous = library.pdserve_bf16_tiles()
    try:
        for rows in BF16_TILES_PROBE_ROWS:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16)
            dpbf16, fma = (
                _bf16_tiles_runner(library, kind, x, weights, out) for kind in ("dpbf16", "fma")
            )
            if not first_is_faster(dpbf16, fma):
                return "fma"
        return "dpbf16"
    finally:
        library.pdserve_use_bf16_tiles(previous)


def _bf16_tiles_runner(
    library: ctypes.CDLL, kind: str, x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor
) -> Callable[[], None]:
    """A call that multiplies ``x`` by each of ``weights`` with bf16 tile kernel ``kind``."""
    rows, in_features = x.shape
    out_features = out.shape[1]

    def run() -> None:
        library.pdserve_use_bf16_tiles(BF16_TILES[kind])
        for weight in weights:
            library.pdserve_linear_bf16(
                x.data_ptr(), in_features, weight.data_ptr(), None, out.data_ptr(),
                out_features, rows, out_features, in_features, 1,
            )  # fmt: skip

    return run


def publish_first(
    path: Path, value: T, encode: Callable[[T], str], read: Callable[[Path], T | None]
) -> T:
    """Write ``encode(value)`` to ``path`` unless another process wrote first, and return what
    ``path`` holds: what processes that must agree (on a plan, a kernel) chose, the first
    choice written winning. A file there that ``read`` cannot make sense of is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, private = tempfile.mkstemp(prefix=path.stem, dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(encode(value))
        os.link(private, path)  # fails if the file exists: the first one written stays
    except FileExistsError:
        stored = read(path)
        if stored is not None:
            return stored
        os.replace(private, path)  # not a choice: this one takes its place
        return value
    finally:
        if os.path.exists(private):
            os.unlink(private)
    return value
