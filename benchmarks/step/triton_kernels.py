"""Speed of the Triton attention kernels on a CUDA GPU: beside other implementations, or, with
``--tune``, tile candidate by tile candidate.

Prefill: TFLOP/s of chunked-prefill attention over the paged pool, beside torch SDPA (and
flash-attn / FlashInfer where installed) on the same shapes with contiguous K/V. FLOPs count only
the causally allowed scores (4 * head_dim per query-key pair and head), the same for every
implementation. One line per case, of the form (T: TFLOP/s; R: a multiple of bf16's)::

      1 x (0 cached + 4096 new)      triton bf16 T | triton fp8 T (Rx bf16) | torch sdpa T

Decode: GB/s of paged decode attention (K/V pages, 8-bit pages' scales, queries and outputs
read or written once) against the GPU's memory bandwidth: its specification where torch reports
the memory clock and bus width, and what a device-to-device copy reaches. One line per case::

      64 x 2048 tokens, S splits           bf16 B GB/s (P%) | fp8 B GB/s (P%) (Rx bf16)

FP8 and int8 pages are also given as a multiple of bf16 pages' speed on the same shape (TFLOP/s
for prefill, tokens/s for decode), where bf16 is measured too.

``--tune`` times every candidate of ``kernels.triton.tiles`` on the same shapes (bf16 queries,
by default bf16 and FP8 pages) instead, prints each case's figures beside the default's, and for
each kind of page the candidate with the best geometric-mean speed over all cases, then the line
that records it in ``kernels/triton/tiles.py``::

      best: TILES at Gx the default (m128 n64 w8 s2) in geometric mean, Wx in its worst case
      TUNED_PREFILL[((9, 0), "none")] = PrefillTiles(block_m=..., block_n=..., ...)

Recording is a person's decision: the table fixes the kernels' sums (deterministic inference
included) on that generation of GPU.

    python -m benchmarks.step.triton_kernels [--kv-dtypes bf16,fp8,int8] [--only prefill|decode]
    python -m benchmarks.step.triton_kernels --tune [--kv-dtypes bf16,fp8] [--only prefill|decode]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
import triton.testing

from kernels.interface import (
    FP8_DTYPE,
    INT8_DTYPE,
    INT8_SCALE_DTYPE,
    AttentionMetadata,
    KVCacheView,
)
from kernels.kv_formats import quantize_fp8, quantize_int8
from kernels.sizes import ceil_div
from kernels.triton.decode_attention import decode_attention, default_num_splits
from kernels.triton.paged import QUANTIZED
from kernels.triton.prefill_attention import prefill_attention
from kernels.triton.tiles import (
    DECODE_CANDIDATES,
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    PREFILL_CANDIDATES,
    DecodeTiles,
    PrefillTiles,
)

PAGE_SIZE = 16
# Llama-3-8B's attention: 32 query heads over 8 KV heads of 128. A pool laid out for two layers
# gives pages the stride of a real multi-layer pool.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 8, 128, 2
DTYPE = torch.bfloat16
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "int8": INT8_DTYPE}
# The quantised pages' scales (one per token and head) and how their values are made.
SCALES = {FP8_DTYPE: (torch.float32, quantize_fp8), INT8_DTYPE: (INT8_SCALE_DTYPE, quantize_int8)}


def kv_bytes(kv_dtype: torch.dtype, tokens: int) -> int:
    """Bytes of K and V pages, and their scales, that ``tokens`` tokens take (all KV heads)."""
    scale_dtype = SCALES[kv_dtype][0] if kv_dtype in SCALES else None
    per_value = HEAD_DIM * kv_dtype.itemsize + (scale_dtype.itemsize if scale_dtype else 0)
    return 2 * tokens * NUM_KV_HEADS * per_value


@dataclass(frozen=True)
class PrefillCase:
    num_seqs: int
    prefix: int  # cached tokens before the chunk
    chunk: int  # new query tokens per sequence

    def __str__(self) -> str:
        return f"{self.num_seqs} x ({self.prefix} cached + {self.chunk} new)"

    @property
    def flops(self) -> float:
        # Query j of a chunk sees prefix + j + 1 keys; QK^T and PV are 2 * head_dim flops each.
        pairs = self.chunk * self.prefix + self.chunk * (self.chunk + 1) / 2
        return 4.0 * HEAD_DIM * NUM_HEADS * self.num_seqs * pairs


PREFILL_CASES = [
    PrefillCase(1, 0, 1024),
    PrefillCase(1, 0, 4096),
    PrefillCase(1, 0, 16384),
    PrefillCase(4, 0, 2048),
    PrefillCase(1, 4096, 512),
    PrefillCase(8, 2048, 256),
    PrefillCase(1, 16384, 2048),
]

# (num_seqs, context length)
DECODE_CASES = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (128, 1024), (256, 4096)]


def time_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def paged_inputs(
    query_lens: list[int], seq_lens: list[int], kv_dtype: torch.dtype
) -> tuple[torch.Tensor, KVCacheView, AttentionMetadata]:
    """A filled pool with each sequence's pages in random order, and its metadata."""
    pages_per_seq = [ceil_div(n, PAGE_SIZE) for n in seq_lens]
    num_pages = sum(pages_per_seq)
    shape = (num_pages, NUM_LAYERS, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # Only layer 0 is read: fill it alone, one half at a time, to keep the peak memory down.
    data = torch.empty(shape, dtype=kv_dtype, device="cuda")
    scales = None
    if kv_dtype in SCALES:
        scale_dtype, quantize = SCALES[kv_dtype]
        scales = torch.empty(shape[:-1], dtype=scale_dtype, device="cuda")
    for half in (0, 1):
        values = torch.randn(data[:, 0, half].shape, dtype=DTYPE, device="cuda")
        if scales is None:
            data[:, 0, half] = values
        else:
            quantized, scale = quantize(values)
            data[:, 0, half].copy_(quantized)
            scales[:, 0, half] = scale
        del values
    cache = KVCacheView(
        data[:, 0, 0],
        data[:, 0, 1],
        None if scales is None else scales[:, 0, 0],
        None if scales is None else scales[:, 0, 1],
    )
    order = torch.randperm(num_pages, device="cuda").to(torch.int32)
    tables = torch.zeros((len(seq_lens), max(pages_per_seq)), dtype=torch.int32, device="cuda")
    used = 0
    for i, count in enumerate(pages_per_seq):
        tables[i, :count] = order[used : used + count]
        used += count
    starts = torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        page_tables=tables,
        slot_mapping=torch.zeros(0, dtype=torch.int64, device="cuda"),  # attention reads none
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return query, cache, meta


def baselines(case: PrefillCase) -> dict[str, Callable[[], object]]:
    """The comparison kernels on contiguous K/V, each only where it is installed."""
    seq_len = case.prefix + case.chunk
    q = torch.randn(case.num_seqs, case.chunk, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (
        torch.randn(case.num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        for _ in range(2)
    )
    scale = HEAD_DIM**-0.5
    fns: dict[str, Callable[[], object]] = {}

    # SDPA without GQA support in its fused kernels: expand K/V heads outside the timing.
    group = NUM_HEADS // NUM_KV_HEADS
    q_t = q.transpose(1, 2)
    k_t, v_t = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    if case.prefix == 0:
        fns["torch sdpa"] = lambda: F.scaled_dot_product_attention(
            q_t, k_t, v_t, is_causal=True, scale=scale
        )
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(case.chunk, seq_len)
        fns["torch sdpa"] = lambda: F.scaled_dot_product_attention(
            q_t, k_t, v_t, attn_mask=mask, scale=scale
        )

    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        pass
    else:
        cu_q = torch.arange(case.num_seqs + 1, dtype=torch.int32, device="cuda") * case.chunk
        cu_k = torch.arange(case.num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
        q_flat, k_flat, v_flat = (x.flatten(0, 1) for x in (q, k, v))
        # flash-attn aligns a causal mask with q shorter than k to the bottom right, as we do.
        fns["flash-attn"] = lambda: flash_attn_varlen_func(
            q_flat,
            k_flat,
            v_flat,
            cu_q,
            cu_k,
            case.chunk,
            seq_len,
            causal=True,
            softmax_scale=scale,
        )

    try:
        import flashinfer
    except ImportError:
        pass
    else:
        if case.num_seqs == 1:
            fns["flashinfer"] = lambda: flashinfer.single_prefill_with_kv_cache(
                q[0], k[0], v[0], causal=True, sm_scale=scale
            )
    return fns


def bench_prefill(kv_dtypes: list[str]) -> None:
    print(
        f"\nprefill attention, TFLOP/s (bf16 queries; {NUM_HEADS}/{NUM_KV_HEADS} heads of "
        f"{HEAD_DIM}; paged KV, page {PAGE_SIZE}; baselines read contiguous bf16 K/V)"
    )
    for case in PREFILL_CASES:
        results = []
        seq_lens = [case.prefix + case.chunk] * case.num_seqs
        bf16_ms = None
        for name in kv_dtypes:
            query, cache, meta = paged_inputs(
                [case.chunk] * case.num_seqs, seq_lens, KV_DTYPES[name]
            )
            ms = time_ms(functools.partial(prefill_attention, query, cache, meta, HEAD_DIM**-0.5))
            bf16_ms = ms if name == "bf16" else bf16_ms
            results.append(
                f"triton {name} {case.flops / ms / 1e9:7.1f}{_versus(name, bf16_ms, ms)}"
            )
            del query, cache, meta
        for name, fn in baselines(case).items():
            try:
                ms = time_ms(fn)
            except Exception as error:  # a baseline that can't run this shape is not our failure
                results.append(f"{name} n/a ({type(error).__name__})")
            else:
                results.append(f"{name} {case.flops / ms / 1e9:7.1f}")
        torch.cuda.empty_cache()
        print(f"  {case!s:30} " + " | ".join(results))


def peak_bandwidth() -> float | None:
    """The specification's memory bandwidth in bytes/s, where torch reports what it needs."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms * 1e3


def bench_decode(kv_dtypes: list[str]) -> None:
    peak = peak_bandwidth()
    copy = copy_bandwidth()
    reference = peak or copy
    print(
        f"\ndecode attention, GB/s (bf16 queries; {NUM_HEADS}/{NUM_KV_HEADS} heads of {HEAD_DIM}; "
        f"page {PAGE_SIZE})"
    )
    print(
        f"  memory bandwidth: specification "
        f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}, "
        f"device copy {copy / 1e9:.0f} GB/s; percentages are of the "
        f"{'specification' if peak else 'copy'}"
    )
    for num_seqs, context in DECODE_CASES:
        results = []
        splits = default_num_splits(num_seqs, NUM_KV_HEADS, context, torch.device("cuda"))
        bf16_ms = None
        for name in kv_dtypes:
            kv_dtype = KV_DTYPES[name]
            query, cache, meta = paged_inputs([1] * num_seqs, [context] * num_seqs, kv_dtype)
            ms = time_ms(functools.partial(decode_attention, query, cache, meta, HEAD_DIM**-0.5))
            io_bytes = 2 * query.numel() * query.element_size()
            rate = (kv_bytes(kv_dtype, num_seqs * context) + io_bytes) / ms * 1e3
            bf16_ms = ms if name == "bf16" else bf16_ms
            results.append(
                f"{name} {rate / 1e9:6.0f} GB/s ({100 * rate / reference:3.0f}%)"
                f"{_versus(name, bf16_ms, ms)}"
            )
            del query, cache, meta
            torch.cuda.empty_cache()
        label = f"{num_seqs} x {context} tokens, {splits} split{'s' if splits > 1 else ''}"
        print(f"  {label:36} " + " | ".join(results))


def _versus(name: str, bf16_ms: float | None, ms: float) -> str:
    """`` (1.23x bf16)`` for an 8-bit page's figure where bf16 pages ran the same shape."""
    if name == "bf16" or bf16_ms is None:
        return ""
    return f" ({bf16_ms / ms:.2f}x bf16)"


def kv_dtype_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The names in ``--kv-dtypes``, less FP8 where the GPU has no e4m3 (before 8.9)."""
    names = [name for name in text.split(",") if name]
    unknown = set(names) - set(KV_DTYPES)
    if unknown:
        parser.error(f"unknown KV dtypes {sorted(unknown)}; choose from {sorted(KV_DTYPES)}")
    if torch.cuda.get_device_capability() < (8, 9) and "fp8" in names:
        print("FP8 KV needs compute capability 8.9 or newer; leaving FP8 pages out.")
        names.remove("fp8")
    return names


# -- tuning the tiles ------------------------------------------------------------------------------

Tiles = TypeVar("Tiles", PrefillTiles, DecodeTiles)


def candidate_ms(fn: Callable[[], object]) -> float | None:
    """Median milliseconds, or None where the candidate cannot run (shared memory, registers)."""
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as error:  # triton's OutOfResources and compile errors alike
        print(f"    ({type(error).__name__}: {str(error).splitlines()[0][:80]})")
        return None


def kv_quant_flag(kv_dtype: torch.dtype) -> str:
    return QUANTIZED.get(kv_dtype, ("none", None))[0]


def report_candidates(
    title: str,
    unit: str,
    candidates: Sequence[Tiles],
    default: Tiles,
    rows: dict[str, list[float | None]],  # case label -> figure per candidate (higher is better)
) -> Tiles:
    """Print the figures and return the candidate with the best geometric-mean gain over the
    default across the cases (one that failed anywhere is out)."""
    print(f"\n{title} ({unit}; columns are the candidates)")
    names = [str(tiles) for tiles in candidates]
    print(f"  {'case':34} " + " ".join(f"{name:>16}" for name in names))
    for label, figures in rows.items():
        cells = ["n/a" if f is None else f"{f:.1f}" for f in figures]
        print(f"  {label:34} " + " ".join(f"{cell:>16}" for cell in cells))
    base = candidates.index(default)
    gains: dict[int, float] = {}
    for i in range(len(candidates)):
        ratios = [f[i] / f[base] for f in rows.values() if f[i] is not None and f[base]]
        if len(ratios) == len(rows):
            gains[i] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    best = max(gains, key=gains.__getitem__, default=base)
    worst_case = min((f[best] / f[base] for f in rows.values() if f[best] and f[base]), default=1.0)
    print(
        f"  best: {candidates[best]} at {gains.get(best, 1.0):.2f}x the default "
        f"({default}) in geometric mean, {worst_case:.2f}x in its worst case"
    )
    return candidates[best]


def tune_prefill(kv_name: str, kv_dtype: torch.dtype) -> PrefillTiles:
    rows: dict[str, list[float | None]] = {}
    for case in PREFILL_CASES:
        seq_lens = [case.prefix + case.chunk] * case.num_seqs
        query, cache, meta = paged_inputs([case.chunk] * case.num_seqs, seq_lens, kv_dtype)
        figures = []
        for tiles in PREFILL_CANDIDATES:
            run = functools.partial(
                prefill_attention, query, cache, meta, HEAD_DIM**-0.5, tiles=tiles
            )
            ms = candidate_ms(run)
            figures.append(None if ms is None else case.flops / ms / 1e9)
        rows[str(case)] = figures
        del query, cache, meta
        torch.cuda.empty_cache()
    title = f"prefill attention over {kv_name} pages"
    return report_candidates(title, "TFLOP/s", PREFILL_CANDIDATES, DEFAULT_PREFILL, rows)


def tune_decode(kv_name: str, kv_dtype: torch.dtype) -> DecodeTiles:
    rows: dict[str, list[float | None]] = {}
    for num_seqs, context in DECODE_CASES:
        query, cache, meta = paged_inputs([1] * num_seqs, [context] * num_seqs, kv_dtype)
        splits = default_num_splits(num_seqs, NUM_KV_HEADS, context, query.device)
        pages_bytes = kv_bytes(kv_dtype, num_seqs * context)
        figures = []
        for tiles in DECODE_CANDIDATES:
            run = functools.partial(
                decode_attention, query, cache, meta, HEAD_DIM**-0.5, tiles=tiles
            )
            ms = candidate_ms(run)
            figures.append(None if ms is None else pages_bytes / ms / 1e6)
        rows[f"{num_seqs} x {context} tokens, {splits} splits"] = figures
        del query, cache, meta
        torch.cuda.empty_cache()
    title = f"decode attention over {kv_name} pages"
    return report_candidates(title, "GB/s of pages read", DECODE_CANDIDATES, DEFAULT_DECODE, rows)


def tune(kv_names: list[str], only: str | None) -> None:
    """Every tile candidate on each kind of page, and the lines that would record the best."""
    capability = torch.cuda.get_device_capability()
    print(f"compute capability {capability}")
    choices: list[str] = []
    for name in kv_names:
        kv_dtype, flag = KV_DTYPES[name], kv_quant_flag(KV_DTYPES[name])
        if only in (None, "prefill"):
            tiles = tune_prefill(name, kv_dtype)
            choices.append(f'TUNED_PREFILL[({capability}, "{flag}")] = {tiles!r}')
        if only in (None, "decode"):
            tiles = tune_decode(name, kv_dtype)
            choices.append(f'TUNED_DECODE[({capability}, "{flag}")] = {tiles!r}')
    print("\nfor kernels/triton/tiles.py (heads of up to 128):")
    for line in choices:
        print(f"  {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--kv-dtypes",
        default=None,
        help="comma-separated subset of bf16,fp8,int8 (default: all three; bf16,fp8 to --tune)",
    )
    parser.add_argument("--only", choices=("prefill", "decode"), help="one kernel")
    parser.add_argument(
        "--tune", action="store_true", help="time every tile candidate and print the best"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.step.triton_kernels measures the Triton kernels on a CUDA GPU; none is "
              "visible.")  # fmt: skip
        return 0
    default_kv_dtypes = "bf16,fp8" if args.tune else "bf16,fp8,int8"
    kv_dtypes = kv_dtype_names(parser, args.kv_dtypes or default_kv_dtypes)
    print(f"device: {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    if args.tune:
        tune(kv_dtypes, args.only)
        return 0
    if args.only in (None, "prefill"):
        bench_prefill(kv_dtypes)
    if args.only in (None, "decode"):
        bench_decode(kv_dtypes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
