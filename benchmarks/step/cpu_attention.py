"""Attention of the CPU path (the C kernels over the paged pool) on one pinned core, in three
parts, each a subcommand.

``decode``: one decode step's attention, every layer. A decode step reads each layer's KV pages
after that layer's weights have streamed through the caches, so the pages come from memory, not
from cache. This part lays out a pool as the engine does (page-major, every layer of a page
together, pages handed out in random order), evicts the caches between layers by reading a
layer's worth of weights, and times the attention calls alone. It prints, per batch and context,
milliseconds per step (all layers) and the rate at which the KV pages were read, beside the rate
at which this core reads a plain buffer (measured in the same run)::

    batch x context    ms/step (median, best)    KV read     GB/s   of read rate
        8 x   256        0.87 (    0.83)        6.3 MB     7.6      61.4%

``window``: the decode step of ``decode`` at long contexts, attending the whole context against
a sliding window's last ``--window`` positions (Mistral's layers): the pages before the window
are not read at all. It prints both steps' milliseconds, the KV each reads, and the speed-up::

    batch x context    full ms   KV read    window ms   KV read   speed-up
        1 x  8192       ...

``prefill``: SDPA against the AMX kernel, one layer's call per shape. Long chunks of bf16
queries over bf16 pages attend on AMX tiles where the processor has them
(``kernels/cpu/prefill_attention.c``), and in SDPA's blocked kernel elsewhere. This part times
both on the same pages, for whole prompts of 256 to 2048 tokens, eight prompts of 256 side by
side (one step of ``benchmarks.step.step``'s prefill), and chunks after a cached prefix. It
prints each path's milliseconds per layer, its rate in GFLOP/s (the causal half of the products
only), and the AMX kernel's speed-up; where the processor has no AMX, SDPA's columns alone::

    chunk rows x context (x chunks)    SDPA ms  GFLOP/s     AMX ms  GFLOP/s   speed-up
      2048 x  2048 (x 1)              70.38       69

Shapes are SmolLM2-135M's (30 layers, 9 query heads over 3 KV heads of 64) unless given.

    python -m benchmarks.step.cpu_attention decode [--core 0] [--kv-cache-dtype bf16|int8|fp8]
        [--bf16-pair-scores]   # bf16 pages scored with vdpbf16ps (AVX512_BF16 processors)
        [--small-pages]   # the pool on 4 KB memory pages (the engine puts it on 2 MB ones)
    python -m benchmarks.step.cpu_attention window [--core 0] [--window 1024]
    python -m benchmarks.step.cpu_attention prefill [--core 0] [--heads 9] [--kv-heads 3]
        [--head-dim 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks.harness import add_core_argument, memory_read_seconds, pin_to_cores
from kernels.cpu import library as cpu_library
from kernels.cpu.backend import CpuAttentionBackend
from kernels.cpu.huge_pages import zeros_on_huge_pages
from kernels.interface import FP8_DTYPE, INT8_DTYPE, SCALE_DTYPES, AttentionMetadata, KVCacheView
from kernels.sizes import ceil_div
from kernels.timing import best_seconds

PAGE_SIZE = 16
KV_DTYPES = {"bf16": torch.bfloat16, "int8": INT8_DTYPE, "fp8": FP8_DTYPE}
# (batch, context) of a decode step
DECODE_CASES = [(1, 256), (8, 256), (32, 256), (1, 1024), (8, 1024), (32, 1024)]
# (batch, context) of a decode step at long contexts, with and without a window
WINDOW_CASES = [(1, 4096), (8, 4096), (1, 16384), (4, 16384)]
# (query rows of each chunk, its sequence's length, chunks side by side)
PREFILL_CASES = [
    (256, 256, 1),
    (512, 512, 1),
    (1024, 1024, 1),
    (1792, 1792, 1),
    (2048, 2048, 1),
    (256, 256, 8),
    (512, 2048, 1),
    (64, 1024, 1),
    (32, 2048, 1),
]


def paged_metadata(query_len: int, seq_len: int, count: int, num_pages: int) -> AttentionMetadata:
    """``count`` sequences of ``seq_len`` tokens, each computing its last ``query_len`` (1: a
    decode step), their pages drawn in random order from a pool of ``num_pages``."""
    per_seq = ceil_div(seq_len, PAGE_SIZE)
    order = torch.randperm(num_pages).to(torch.int32)
    tables = order[: count * per_seq].view(count, per_seq).contiguous()
    positions = torch.arange(seq_len - query_len, seq_len)
    slots = tables[:, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE
    return AttentionMetadata(
        query_start_loc=torch.arange(count + 1, dtype=torch.int32) * query_len,
        seq_lens=torch.full((count,), seq_len, dtype=torch.int32),
        page_tables=tables,
        slot_mapping=slots.flatten(),
        max_query_len=query_len,
        max_seq_len=seq_len,
    )


# -- decode --------------------------------------------------------------------------------------


def make_pool(num_pages: int, args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random pages (and scales) of every layer: (num_pages, num_layers, 2, page, kv_heads, dim),
    on 2 MB pages as the engine's pool is (common/engine/kv_pool.py), unless ``--small-pages``."""
    shape = (num_pages, args.layers, 2, PAGE_SIZE, args.kv_heads, args.head_dim)
    dtype = KV_DTYPES[args.kv_cache_dtype]
    pages = (
        torch.zeros(shape, dtype=dtype) if args.small_pages else zeros_on_huge_pages(shape, dtype)
    )
    if dtype == torch.bfloat16:
        pages.copy_(torch.randn(shape))
        return pages, None
    if dtype == INT8_DTYPE:
        pages.copy_(torch.randint(-127, 128, shape, dtype=torch.int8))
        scales = torch.randint(100, 140, shape[:-1], dtype=torch.int32).to(SCALE_DTYPES[dtype])
        return pages, scales
    pages.copy_(torch.randn(shape).clamp(-400, 400))
    return pages, torch.rand(shape[:-1]).to(SCALE_DTYPES[dtype]) + 0.5


def layer_view(pages: torch.Tensor, scales: torch.Tensor | None, layer: int) -> KVCacheView:
    if scales is None:
        return KVCacheView(pages[:, layer, 0], pages[:, layer, 1])
    return KVCacheView(
        pages[:, layer, 0], pages[:, layer, 1], scales[:, layer, 0], scales[:, layer, 1]
    )


class DecodeSteps:
    """A pool of every layer's pages and a step of decodes over it, timed layer by layer with a
    layer's share of the weights read between layers, as in a decode step."""

    def __init__(self, cases: list[tuple[int, int]], args: argparse.Namespace) -> None:
        self.backend = CpuAttentionBackend()
        self.num_pages = max(b * ceil_div(c, PAGE_SIZE) for b, c in cases) + 1
        pages, scales = make_pool(self.num_pages, args)
        self.views = [layer_view(pages, scales, layer) for layer in range(args.layers)]
        self.weights = torch.ones((args.weight_mb << 20) // args.layers // 4)
        scale_bytes = 0 if scales is None else scales.element_size()
        self.token_bytes = 2 * args.kv_heads * (args.head_dim * pages.element_size() + scale_bytes)
        self.args = args

    def seconds(self, batch: int, context: int, window: int | None = None) -> list[float]:
        """Each pass's seconds of attention over every layer (the warm-up pass dropped)."""
        args = self.args
        meta = self.backend.plan(paged_metadata(1, context, batch, self.num_pages))
        query = torch.randn(batch, args.heads, args.head_dim).to(torch.bfloat16)
        scale = args.head_dim**-0.5
        times = []
        for _ in range(args.repeats + 1):
            total = 0.0
            for view in self.views:
                self.weights.sum()
                start = time.perf_counter()
                self.backend.attention(query, view, meta, scale, window)
                total += time.perf_counter() - start
            times.append(total)
        return times[1:]  # the first pass warms the allocator

    def kv_bytes(self, batch: int, context: int, window: int | None = None) -> int:
        """The bytes of the pages a step reads: from the page of the window's first position."""
        first_page = 0 if window is None else max(0, context - window) // PAGE_SIZE
        read = context - first_page * PAGE_SIZE
        return self.args.layers * batch * read * self.token_bytes


def run_decode(args: argparse.Namespace) -> None:
    steps = DecodeSteps(DECODE_CASES, args)
    memory_rate = (args.weight_mb << 20) / memory_read_seconds(args.weight_mb << 20, args.repeats)

    print(
        f"{args.layers} layers, {args.heads} query heads over {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.kv_cache_dtype} pages of {PAGE_SIZE} on "
        f"{'4 KB' if args.small_pages else '2 MB'} memory pages; one core (#{args.core})"
        + ("; bf16 pair scores" if args.bf16_pair_scores else "")
    )
    print(f"memory read rate: {memory_rate / 1e9:.1f} GB/s")
    print()
    print("batch x context    ms/step (median, best)    KV read     GB/s   of read rate")
    for batch, context in DECODE_CASES:
        times = steps.seconds(batch, context)
        kv_bytes = steps.kv_bytes(batch, context)
        rate = kv_bytes / min(times)
        print(
            f"{batch:5d} x {context:5d}    {statistics.median(times) * 1e3:8.2f} "
            f"({min(times) * 1e3:8.2f})    {kv_bytes / 1e6:7.1f} MB  {rate / 1e9:6.1f}"
            f"   {rate / memory_rate:8.1%}"
        )


def run_window(args: argparse.Namespace) -> None:
    steps = DecodeSteps(WINDOW_CASES, args)
    print(
        f"{args.layers} layers, {args.heads} query heads over {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.kv_cache_dtype} pages of {PAGE_SIZE}; a window of "
        f"{args.window} positions; one core (#{args.core}); medians of {args.repeats}"
    )
    print()
    print("batch x context    full ms   KV read    window ms   KV read   speed-up")
    for batch, context in WINDOW_CASES:
        full = statistics.median(steps.seconds(batch, context)) * 1e3
        windowed = statistics.median(steps.seconds(batch, context, args.window)) * 1e3
        print(
            f"{batch:5d} x {context:5d}  {full:8.2f} {steps.kv_bytes(batch, context) / 1e6:7.1f} MB"
            f"  {windowed:9.2f} {steps.kv_bytes(batch, context, args.window) / 1e6:7.1f} MB"
            f"  {full / windowed:7.1f}x"
        )


# -- prefill -------------------------------------------------------------------------------------


def causal_gflop(query_len: int, seq_len: int, heads: int, head_dim: int) -> float:
    """Both products over the keys each row sees: 4 * head_dim FLOPs per (row, key, head)."""
    prefix = seq_len - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * head_dim * heads * pairs / 1e9


def run_prefill(args: argparse.Namespace) -> None:
    backend = CpuAttentionBackend()
    amx = bool(cpu_library.load().pdserve_prefill_attention_available())
    print(
        f"{args.heads} query heads over {args.kv_heads} KV heads of {args.head_dim}, bf16 pages "
        f"of {PAGE_SIZE}; one core (#{args.core}); AMX kernel: {'yes' if amx else 'no AMX here'}"
    )
    print()
    print("chunk rows x context (x chunks)    SDPA ms  GFLOP/s     AMX ms  GFLOP/s   speed-up")
    scale = args.head_dim**-0.5
    for query_len, seq_len, count in PREFILL_CASES:
        num_pages = count * ceil_div(seq_len, PAGE_SIZE)
        meta = paged_metadata(query_len, seq_len, count, num_pages)
        shape = (num_pages, PAGE_SIZE, args.kv_heads, args.head_dim)
        cache = KVCacheView(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
        query = torch.randn(count * query_len, args.heads, args.head_dim).bfloat16()
        plan = backend.plan(meta)
        gflop = count * causal_gflop(query_len, seq_len, args.heads, args.head_dim)
        attend = functools.partial(backend.attention, query, cache, plan, scale)
        backend.prefill_on_amx = False
        sdpa = best_seconds(attend, args.repeats) * 1e3
        line = f"{query_len:6d} x {seq_len:5d} (x {count})          "
        line += f"{sdpa:9.2f} {gflop / sdpa * 1e3:8.0f}"
        if amx:
            backend.prefill_on_amx = True
            on_amx = best_seconds(attend, args.repeats) * 1e3
            line += f"  {on_amx:9.2f} {gflop / on_amx * 1e3:8.0f}   {sdpa / on_amx:7.2f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    shape = argparse.ArgumentParser(add_help=False)
    add_core_argument(shape)
    shape.add_argument("--heads", type=int, default=9)
    shape.add_argument("--kv-heads", type=int, default=3)
    shape.add_argument("--head-dim", type=int, default=64)
    parts = parser.add_subparsers(dest="part", required=True)
    decode = parts.add_parser("decode", parents=[shape], help="a decode step, every layer")
    decode.add_argument("--kv-cache-dtype", default="bf16", choices=sorted(KV_DTYPES))
    decode.add_argument("--layers", type=int, default=30)
    decode.add_argument("--weight-mb", type=int, default=270, help="weights streamed per step")
    decode.add_argument("--repeats", type=int, default=8)
    decode.add_argument("--bf16-pair-scores", action="store_true", help="score with vdpbf16ps")
    decode.add_argument(
        "--small-pages", action="store_true", help="the pool on 4 KB pages, not 2 MB ones"
    )
    window = parts.add_parser(
        "window", parents=[shape], help="a decode step at long contexts, with a sliding window"
    )
    window.add_argument("--window", type=int, default=1024)
    window.add_argument("--kv-cache-dtype", default="bf16", choices=sorted(KV_DTYPES))
    window.add_argument("--layers", type=int, default=30)
    window.add_argument("--weight-mb", type=int, default=270, help="weights streamed per step")
    window.add_argument("--repeats", type=int, default=5)
    window.add_argument(
        "--small-pages", action="store_true", help="the pool on 4 KB pages, not 2 MB ones"
    )
    prefill = parts.add_parser("prefill", parents=[shape], help="SDPA against the AMX kernel")
    prefill.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pin_to_cores({args.core})
    torch.manual_seed(0)
    if args.part == "prefill":
        run_prefill(args)
        return
    if args.part == "window":
        run_window(args)
        return
    with cpu_library.running_bf16_pair_scores(args.bf16_pair_scores):
        run_decode(args)


if __name__ == "__main__":
    main()
