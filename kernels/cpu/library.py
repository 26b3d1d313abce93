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
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kernels.cpu.features import cpu_fingerprint, cpu_flags
from kernels.cpu.tile_choice import BF16_TILES, default_bf16_tiles, pair_scores_wanted

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
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


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "kernels"


def compile_flags() -> list[str]:
    """CFLAGS, and AVX512_CFLAGS where the processor has AVX-512."""
    return CFLAGS + (AVX512_CFLAGS if "avx512f" in cpu_flags() else [])


def build_digest(compiler: str = "") -> str:
    """A digest of what the kernels' speed depends on: their sources, flags and this CPU."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join([compiler, *compile_flags()]).encode())
    digest.update(cpu_fingerprint().encode())
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
    library.pdserve_use_bf16_tiles(BF16_TILES[default_bf16_tiles(library, path)])
    library.pdserve_use_bf16_pair_scores(int(pair_scores_wanted(library)))
    return library


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
        f32, i32, i32, i32,  # softmax scale, sliding window (0: none), query/output dtype, threads
    ]  # fmt: skip
    library.pdserve_paged_attention.restype = ctypes.c_int
    library.pdserve_linear_bf16.argtypes = [
        ptr, i64, ptr, ptr, ptr, i64,  # x, its row stride, packed w, bias, y, its row stride
        i32, i32, i32, i32,  # M, N, K, threads
    ]  # fmt: skip
    library.pdserve_linear_bf16.restype = ctypes.c_int
    library.pdserve_linear_f32.argtypes = library.pdserve_linear_bf16.argtypes
    library.pdserve_linear_f32.restype = ctypes.c_int
    library.pdserve_quantized_tile_bytes.argtypes = [i32, i32, i32, i32]
    library.pdserve_quantized_tile_bytes.restype = ctypes.c_int
    library.pdserve_quantized_linear.argtypes = [
        ptr, i64, ptr, i32,  # x, its row stride, packed tiles, code kind
        i32, i32, ptr,  # group size, whether there are offsets, bias
        ptr, i64, i32,  # y, its row stride, the dtype of x and y
        i32, i32, i32, i32,  # M, N, K, threads
    ]  # fmt: skip
    library.pdserve_quantized_linear.restype = ctypes.c_int
    library.pdserve_quantized_dequantize.argtypes = [
        ptr, i32, i32, i32,  # packed tiles, code kind, group size, whether there are offsets
        ptr, i32, i32,  # out, its dtype, whether it is [K, N] rather than [N, K]
        i32, i32, i32,  # N, K, threads
    ]  # fmt: skip
    library.pdserve_quantized_dequantize.restype = ctypes.c_int
    library.pdserve_quantized_quads_available.argtypes = []
    library.pdserve_quantized_quads_available.restype = ctypes.c_int
    library.pdserve_round_activations.argtypes = [
        ptr, ptr, i64, ptr, i64,  # the rounding, x, its row stride, out, its row stride
        i32, i32, i32,  # the dtype of x and out, rows, width
    ]  # fmt: skip
    library.pdserve_round_activations.restype = ctypes.c_int
    library.pdserve_decoder_layer_scratch_bytes.argtypes = [ptr, i32]
    library.pdserve_decoder_layer_scratch_bytes.restype = i64
    library.pdserve_decoder_layer_bf16.argtypes = [
        ptr, ptr, i32, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, ptr, i32
    ]  # fmt: skip
    library.pdserve_decoder_layer_bf16.restype = ctypes.c_int
    library.pdserve_lora_delta_bf16.argtypes = [
        ptr, ptr, ptr, ptr, i32,  # the slots, segment starts, ends, slots, how many
        ptr, i64, ptr, i64,  # x, its row stride, y, its row stride
        i32, i32, i32,  # N, K, threads
    ]  # fmt: skip
    library.pdserve_lora_delta_bf16.restype = ctypes.c_int
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
