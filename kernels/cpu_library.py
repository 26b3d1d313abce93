"""Builds the C kernels under ``kernels/cpu/`` into one library per machine; loads it (ctypes).

The library is compiled for the host's own instruction set (``-march=native``) into
``$PDSERVE_CACHE_DIR/kernels`` (default ``~/.cache/pdserve/kernels``), named by a digest of the
source, the flags and the CPU's feature flags, so a changed source or another CPU builds anew and
a restart loads in milliseconds. Concurrent builders (workers starting together) each write a
private file and rename it into place, so nobody loads a half-written library.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = sorted(SOURCE_DIR.glob("*.c"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
# -fno-math-errno and -fno-trapping-math let loops over exp_approx and the clamps in it
# vectorize (a comparison that might trap is otherwise kept as a branch); neither changes a
# result. No -ffast-math: that would reorder sums and flush denormals to zero.
CFLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-std=gnu11",
    "-fno-math-errno",
    "-fno-trapping-math",
]
ENV_CC = "CC"
# On AVX-512 processors gcc still vectorizes loops 256 bits wide unless told otherwise (wide
# vectors once lowered some Xeons' clocks); on a 2-core Xeon with AMX 512-bit SiLU, RoPE and
# RMSNorm ran 1.3-1.4x faster, which prefill's rows feel. The tile kernels use intrinsics of
# their own width either way.
AVX512_CFLAGS = ["-mprefer-vector-width=512"]
# Which kernel multiplies bf16 weight tiles (kernels/cpu/exports.h's bf16_tiles_kind): float32
# FMAs over widened weights, AVX512_BF16's vdpbf16ps, or AMX tiles.
BF16_TILES = {"fma": 0, "dpbf16": 1, "amx": 2}
# Names one of BF16_TILES to run instead of the machine's own choice (_machine_bf16_tiles).
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


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "kernels"


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """This processor's feature flags (``avx512f``, ``amx_bf16``, ...) as /proc/cpuinfo names
    them; empty where it does not say."""
    return frozenset(_cpu_fingerprint().split())


def compile_flags() -> list[str]:
    """CFLAGS, and AVX512_CFLAGS where the processor has AVX-512."""
    return CFLAGS + (AVX512_CFLAGS if "avx512f" in cpu_flags() else [])


def has_amx_bf16() -> bool:
    """Whether this processor multiplies bf16 matrices in AMX tiles (``amx_bf16``): its bf16
    GEMMs then run several times faster than float32 ones, which sets step sizes and kernel
    choices beyond the tiles."""
    return "amx_bf16" in cpu_flags()


def build_digest(compiler: str = "") -> str:
    """A digest of what the kernels' speed depends on: their sources, flags and this CPU."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join([compiler, *compile_flags()]).encode())
    digest.update(_cpu_fingerprint().encode())
    return digest.hexdigest()[:16]


def _library_path(compiler: str) -> Path:
    return cache_dir() / f"pdserve_cpu-{platform.machine()}-{build_digest(compiler)}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, private = tempfile.mkstemp(prefix=target.stem, suffix=".so", dir=target.parent)
    os.close(handle)
    command = [compiler, *compile_flags(), *map(str, SOURCES), "-o", private, "-lm"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise CpuKernelsUnavailable(
                f"{' '.join(command)} failed:\n{result.stderr.strip()[-2000:]}"
            )
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)
    logger.info("built the CPU kernels into %s", target)


def load() -> ctypes.CDLL:
    """The loaded library, built first if this machine has none yet; raises
    ``CpuKernelsUnavailable`` when there is no C compiler or the build fails."""
    library = _load_once()
    if isinstance(library, CpuKernelsUnavailable):
        raise CpuKernelsUnavailable(str(library))
    return library


@functools.cache
def _load_once() -> ctypes.CDLL | CpuKernelsUnavailable:
    """One try a process, failures included: a build that failed fails again (each try costs
    a compiler run), and callers ask ``available`` per step."""
    compiler = os.environ.get(ENV_CC) or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return CpuKernelsUnavailable("no C compiler (gcc or cc) on PATH")
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
    except CpuKernelsUnavailable as error:
        return error
    library = ctypes.CDLL(str(path))
    _declare(library)
    library.pdserve_init()
    library.pdserve_use_bf16_tiles(BF16_TILES[_default_bf16_tiles(library, path)])
    library.pdserve_use_bf16_pair_scores(int(_pair_scores_wanted(library)))
    return library


def _pair_scores_wanted(library: ctypes.CDLL) -> bool:
    """Whether ``ENV_BF16_PAIR_SCORES`` asks for bf16 pair scores and this machine has them."""
    if os.environ.get(ENV_BF16_PAIR_SCORES, "") != "1":
        return False
    if library.pdserve_bf16_pair_scores_available():
        return True
    logger.error(
        "%s=1: this processor has no AVX512_BF16; scoring in float32", ENV_BF16_PAIR_SCORES
    )
    return False


def _default_bf16_tiles(library: ctypes.CDLL, library_path: Path) -> str:
    """The bf16 tile kernel a process runs: ``ENV_BF16_TILES``'s where it names one this
    machine runs, else the machine's own (``_machine_bf16_tiles``), kept beside the library
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
    return _machine_bf16_tiles(library, library_path.with_suffix(".bf16-tiles.json"))


def _machine_bf16_tiles(library: ctypes.CDLL, store: Path) -> str:
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


def bf16_tiles() -> str:
    """The name (a key of ``BF16_TILES``) of the kernel this process multiplies bf16 tiles with."""
    code = load().pdserve_bf16_tiles()
    return next(name for name, value in BF16_TILES.items() if value == code)


def bf16_tiles_available(name: str) -> bool:
    return bool(load().pdserve_bf16_tiles_available(BF16_TILES[name]))


@contextlib.contextmanager
def running_bf16_tiles(name: str):
    """Run bf16 tiles with kernel ``name`` inside the block (tests and benchmarks that compare
    kernels in one process). Tiles packed inside the block are laid out for it and must not be
    used outside it, nor tiles packed before it inside."""
    library = load()
    previous = library.pdserve_bf16_tiles()
    if library.pdserve_use_bf16_tiles(BF16_TILES[name]) != 0:
        raise ValueError(f"this machine does not run bf16 tiles with {name}")
    try:
        yield
    finally:
        library.pdserve_use_bf16_tiles(previous)


def bf16_pair_scores_available() -> bool:
    return bool(load().pdserve_bf16_pair_scores_available())


@contextlib.contextmanager
def running_bf16_pair_scores(on: bool):
    """Score decode attention with bf16 pairs (``on``) or widened float32 inside the block
    (tests and benchmarks that compare the two in one process)."""
    library = load()
    previous = library.pdserve_bf16_pair_scores()
    if library.pdserve_use_bf16_pair_scores(int(on)) != 0:
        raise ValueError("this processor has no AVX512_BF16 to score bf16 pairs with")
    try:
        yield
    finally:
        library.pdserve_use_bf16_pair_scores(previous)


def available() -> bool:
    """Whether the C kernels can be had here (built now if need be; asked again, the answer
    is remembered)."""
    try:
        load()
    except CpuKernelsUnavailable:
        return False
    return True


def best_seconds(fn, repeats: int = 2) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def first_is_faster(first, second, rounds: int = 4) -> bool:
    """Whether ``first`` runs at least as fast as ``second``: the fastest of ``rounds`` timed
    calls each, after one untimed call each, the two taking turns, each call timed by
    ``running_seconds``.

    What the start-up probes compare kernels by, and they persist the answer, so it must hold on
    a busy machine. Two things make it: taking turns, so that a burst of other work (workers
    starting together, a build) slows a call of each, where timing one kernel's calls back to
    back lets one burst cover all of them and reverse a 2x difference; and not counting the time
    the calling thread waited for a core, which on a machine whose cores are all busy is most of
    a call (a probe taken while tests ran beside it once kept a plan whose decode steps were
    16-25 ms slower)."""
    first()
    second()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for which, fn in enumerate((first, second)):
            best[which] = min(best[which], running_seconds(fn))
    return best[0] <= best[1]


def running_seconds(fn) -> float:
    """Seconds one call of ``fn`` took, less the time the calling thread spent ready to run but
    waiting for a core (the run-queue wait Linux keeps per thread in ``schedstat``; none is
    taken off where that is not kept). Waiting for memory still counts: the machine's other
    work can slow a kernel that way, but not reorder two kernels' calls taken in turn."""
    waited = _run_queue_seconds()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed - max(0.0, _run_queue_seconds() - waited)


_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _run_queue_seconds() -> float:
    """This thread's total time ready to run but not running, or 0 where Linux does not say."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _declare(library: ctypes.CDLL) -> None:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    library.pdserve_init.argtypes = []
    library.pdserve_init.restype = None
    library.pdserve_paged_attention.argtypes = [
        ptr, i64, ptr, i64,  # query, its row stride, out, its row stride
        ptr, ptr, ptr, ptr,  # key, value, key_scale, value_scale
        i64, i64, i64,  # page, token, head strides of key/value
        i64, i64, i64,  # page, token, head strides of the scales
        i32, i32,  # kv dtype, page size
        ptr, i64,  # page tables, their row stride
        ptr, ptr, ptr, i32,  # query_start_loc, seq_lens, seq_ids, how many ids
        i32, i32, i32,  # num_heads, num_kv_heads, head_dim
        f32, i32, i32,  # softmax scale, query/output dtype, threads
    ]  # fmt: skip
    library.pdserve_paged_attention.restype = ctypes.c_int
    library.pdserve_linear_bf16.argtypes = [
        ptr, i64, ptr, ptr, ptr, i64,  # x, its row stride, packed w, bias, y, its row stride
        i32, i32, i32, i32,  # M, N, K, threads
    ]  # fmt: skip
    library.pdserve_linear_bf16.restype = ctypes.c_int
    library.pdserve_linear_f32.argtypes = library.pdserve_linear_bf16.argtypes
    library.pdserve_linear_f32.restype = ctypes.c_int
    library.pdserve_decoder_layer_scratch_bytes.argtypes = [ptr, i32]
    library.pdserve_decoder_layer_scratch_bytes.restype = i64
    library.pdserve_decoder_layer_bf16.argtypes = [
        ptr, ptr, i32, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, i32
    ]  # fmt: skip
    library.pdserve_decoder_layer_bf16.restype = ctypes.c_int
    library.pdserve_bf16_tile_order.argtypes = []
    library.pdserve_bf16_tile_order.restype = ctypes.c_int
    library.pdserve_bf16_tiles_available.argtypes = [i32]
    library.pdserve_bf16_tiles_available.restype = ctypes.c_int
    library.pdserve_use_bf16_tiles.argtypes = [i32]
    library.pdserve_use_bf16_tiles.restype = ctypes.c_int
    library.pdserve_bf16_tiles.argtypes = []
    library.pdserve_bf16_tiles.restype = ctypes.c_int
    library.pdserve_bf16_pair_scores_available.argtypes = []
    library.pdserve_bf16_pair_scores_available.restype = ctypes.c_int
    library.pdserve_use_bf16_pair_scores.argtypes = [i32]
    library.pdserve_use_bf16_pair_scores.restype = ctypes.c_int
    library.pdserve_bf16_pair_scores.argtypes = []
    library.pdserve_bf16_pair_scores.restype = ctypes.c_int
    library.pdserve_bf16_pair_scores_of.argtypes = [ptr, ptr, i64, i32, i32, f32, ptr]
    library.pdserve_bf16_pair_scores_of.restype = ctypes.c_int
    library.pdserve_prefill_attention_fits.argtypes = [i32, i32, i32]
    library.pdserve_prefill_attention_fits.restype = ctypes.c_int
    library.pdserve_prefill_attention_available.argtypes = []
    library.pdserve_prefill_attention_available.restype = ctypes.c_int
    library.pdserve_prefill_attention_bf16.argtypes = [
        ptr, i64, ptr, i64,  # query, its row stride, out, its row stride
        ptr, ptr, i64, i64, i64,  # key and value pages; their page, token, head strides
        i32, ptr, i32, i32,  # page size, the page table, query rows, sequence length
        i32, i32, i32, f32, i32,  # num_heads, num_kv_heads, head_dim, softmax scale, threads
    ]  # fmt: skip
    library.pdserve_prefill_attention_bf16.restype = ctypes.c_int
    library.pdserve_store_kv.argtypes = [
        ptr, i64, ptr, i64, ptr, ptr,  # key, its row stride, value, its row stride, caches
        i64, i64, i64, i32, i32,  # page, token, head strides; element bytes; page size
        ptr, i32, i32, i32,  # slots, tokens, kv heads, head_dim
    ]  # fmt: skip
    library.pdserve_store_kv.restype = None
    library.pdserve_store_kv_int8.argtypes = [
        ptr, i64, ptr, i64, i32,  # key, its row stride, value, its row stride, their dtype
        ptr, ptr, i64, i64, i64,  # int8 caches; page, token, head strides
        ptr, ptr, i64, i64, i64,  # scale codes; their page, token, head strides
        i32, ptr, i32, i32, i32,  # page size, slots, tokens, kv heads, head_dim
    ]  # fmt: skip
    library.pdserve_store_kv_int8.restype = ctypes.c_int
    # The same arguments, float32 scales in place of the codes.
    library.pdserve_store_kv_fp8.argtypes = library.pdserve_store_kv_int8.argtypes
    library.pdserve_store_kv_fp8.restype = ctypes.c_int
    library.pdserve_rms_norm_bf16.argtypes = [ptr, i64, ptr, f32, ptr, i64, i32, i32]
    library.pdserve_rms_norm_bf16.restype = None
    library.pdserve_add_rms_norm_bf16.argtypes = [
        ptr, i64, ptr, i64,  # x, its row stride, delta, its row stride
        ptr, f32, ptr, i64, ptr, i64, i32, i32,  # weight, eps, sum, out (row strides), shape
    ]  # fmt: skip
    library.pdserve_add_rms_norm_bf16.restype = None
    library.pdserve_silu_mul_bf16.argtypes = [ptr, i64, ptr, i64, i32, i32]
    library.pdserve_silu_mul_bf16.restype = None
    library.pdserve_argmax_f32.argtypes = [ptr, i64, i32, i32, ptr]
    library.pdserve_argmax_f32.restype = None
    library.pdserve_rope_bf16.argtypes = [ptr, i64, i64, i32, i32, i32, ptr, ptr, i64]
    library.pdserve_rope_bf16.restype = None
