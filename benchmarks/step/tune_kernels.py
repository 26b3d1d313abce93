"""Tile sizes of the Triton attention kernels, tuned on this GPU.

Times every candidate of ``kernels.triton.tiles`` on ``benchmarks.step.triton_kernels``' shapes
(bf16 queries, bf16 and FP8 pages), prints each case's figures beside the default's, and for each
kind of page the candidate with the best geometric-mean speed over all cases, as the line that
records it in ``kernels/triton/tiles.py``. Recording is a person's decision: the table fixes
the kernels' sums (deterministic inference included) on that generation of GPU.

    python -m benchmarks.step.tune_kernels [--kv-dtypes bf16,fp8] [--only prefill|decode]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import triton.testing

from benchmarks.step.triton_kernels import (
    DECODE_CASES,
    HEAD_DIM,
    KV_DTYPES,
    NUM_KV_HEADS,
    PREFILL_CASES,
    kv_dtype_names,
    paged_inputs,
)
from kernels.interface import FP8_DTYPE
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

Tiles = TypeVar("Tiles", PrefillTiles, DecodeTiles)


def time_ms(fn: Callable[[], object]) -> float | None:
    """Median milliseconds, or None where the candidate cannot run (shared memory, registers)."""
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as error:  # triton's OutOfResources and compile errors alike
        print(f"    ({type(error).__name__}: {str(error).splitlines()[0][:80]})")
        return None


def kv_quant_flag(kv_dtype: torch.dtype) -> str:
    return QUANTIZED.get(kv_dtype, ("none", None))[0]


def report(
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
            ms = time_ms(run)
            figures.append(None if ms is None else case.flops / ms / 1e9)
        rows[str(case)] = figures
        del query, cache, meta
        torch.cuda.empty_cache()
    title = f"prefill attention over {kv_name} pages"
    return report(title, "TFLOP/s", PREFILL_CANDIDATES, DEFAULT_PREFILL, rows)


def tune_decode(kv_name: str, kv_dtype: torch.dtype) -> DecodeTiles:
    rows: dict[str, list[float | None]] = {}
    for num_seqs, context in DECODE_CASES:
        query, cache, meta = paged_inputs([1] * num_seqs, [context] * num_seqs, kv_dtype)
        splits = default_num_splits(num_seqs, NUM_KV_HEADS, context, query.device)
        tokens = num_seqs * context
        kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
        kv_bytes += 2 * tokens * NUM_KV_HEADS * 4 if kv_dtype == FP8_DTYPE else 0
        figures = []
        for tiles in DECODE_CANDIDATES:
            run = functools.partial(
                decode_attention, query, cache, meta, HEAD_DIM**-0.5, tiles=tiles
            )
            ms = time_ms(run)
            figures.append(None if ms is None else kv_bytes / ms / 1e6)
        rows[f"{num_seqs} x {context} tokens, {splits} splits"] = figures
        del query, cache, meta
        torch.cuda.empty_cache()
    title = f"decode attention over {kv_name} pages"
    return report(title, "GB/s of pages read", DECODE_CANDIDATES, DEFAULT_DECODE, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-dtypes", default="bf16,fp8", help="subset of bf16,fp8")
    parser.add_argument("--only", choices=("prefill", "decode"), help="tune one kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.step.tune_kernels tunes the Triton kernels on a CUDA GPU; none is here.")
        return 0
    kv_names = kv_dtype_names(parser, args.kv_dtypes)
    capability = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()}, compute capability {capability}")
    torch.manual_seed(0)
    choices: list[str] = []
    for name in kv_names:
        kv_dtype, flag = KV_DTYPES[name], kv_quant_flag(KV_DTYPES[name])
        if args.only in (None, "prefill"):
            tiles = tune_prefill(name, kv_dtype)
            choices.append(f'TUNED_PREFILL[({capability}, "{flag}")] = {tiles!r}')
        if args.only in (None, "decode"):
            tiles = tune_decode(name, kv_dtype)
            choices.append(f'TUNED_DECODE[({capability}, "{flag}")] = {tiles!r}')
    print("\nfor kernels/triton/tiles.py (heads of up to 128):")
    for line in choices:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
