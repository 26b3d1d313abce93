"""Decode attention of the CPU path (the C kernel over the paged pool), one step of every layer.

A decode step reads each layer's KV pages after that layer's weights have streamed through the
caches, so the pages come from memory, not from cache. This benchmark lays out a pool as the
engine does (page-major, every layer of a page together, pages handed out in random order),
evicts the caches between layers by reading a layer's worth of weights, and times the attention
calls alone. It prints milliseconds per step (all layers) and the rate at which the KV pages were
read, beside the rate at which this core reads a plain buffer (measured in the same run).

    python -m benchmarks.step.cpu_decode_attention [--core 0] [--kv-cache-dtype bf16|int8|fp8]
        [--bf16-pair-scores]   # bf16 pages scored with vdpbf16ps (AVX512_BF16 processors)
        [--small-pages]   # the pool on 4 KB memory pages (the engine puts it on 2 MB ones)

Shapes are SmolLM2-135M's (30 layers, 9 query heads over 3 KV heads of 64) unless given.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import add_core_argument, memory_read_seconds, pin_to_cores
from kernels.cpu import library as cpu_library
from kernels.cpu.backend import CpuAttentionBackend
from kernels.cpu.huge_pages import zeros_on_huge_pages
from kernels.interface import FP8_DTYPE, INT8_DTYPE, SCALE_DTYPES, AttentionMetadata, KVCacheView
from kernels.sizes import ceil_div

PAGE_SIZE = 16
KV_DTYPES = {"bf16": torch.bfloat16, "int8": INT8_DTYPE, "fp8": FP8_DTYPE}
CASES = [(1, 256), (8, 256), (32, 256), (1, 1024), (8, 1024), (32, 1024)]


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


def step_metadata(batch: int, context: int, num_pages: int) -> AttentionMetadata:
    """One decode step: each sequence's last token attends its `context` tokens."""
    per_seq = ceil_div(context, PAGE_SIZE)
    order = torch.randperm(num_pages).to(torch.int32)
    tables = order[: batch * per_seq].view(batch, per_seq).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // PAGE_SIZE].long() * PAGE_SIZE + last % PAGE_SIZE
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        page_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=context,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_core_argument(parser)
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=sorted(KV_DTYPES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--weight-mb", type=int, default=270, help="weights streamed per step")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--bf16-pair-scores", action="store_true", help="score with vdpbf16ps")
    parser.add_argument(
        "--small-pages", action="store_true", help="the pool on 4 KB pages, not 2 MB ones"
    )
    args = parser.parse_args()
    with cpu_library.running_bf16_pair_scores(args.bf16_pair_scores):
        run(args)


def run(args) -> None:
    pin_to_cores({args.core})
    torch.manual_seed(0)

    backend = CpuAttentionBackend()
    num_pages = max(b * ceil_div(c, PAGE_SIZE) for b, c in CASES) + 1
    pages, scales = make_pool(num_pages, args)
    views = [layer_view(pages, scales, layer) for layer in range(args.layers)]
    # Between layers, a layer's share of the weights is read, as in a decode step.
    weights = torch.ones((args.weight_mb << 20) // args.layers // 4)
    memory_rate = (args.weight_mb << 20) / memory_read_seconds(args.weight_mb << 20, args.repeats)
    scale = args.head_dim**-0.5
    scale_bytes = 0 if scales is None else scales.element_size()
    token_bytes = 2 * args.kv_heads * (args.head_dim * pages.element_size() + scale_bytes)

    print(
        f"{args.layers} layers, {args.heads} query heads over {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.kv_cache_dtype} pages of {PAGE_SIZE} on "
        f"{'4 KB' if args.small_pages else '2 MB'} memory pages; one core (#{args.core})"
        + ("; bf16 pair scores" if args.bf16_pair_scores else "")
    )
    print(f"memory read rate: {memory_rate / 1e9:.1f} GB/s")
    print()
    print("batch x context    ms/step (median, best)    KV read     GB/s   of read rate")
    for batch, context in CASES:
        meta = backend.plan(step_metadata(batch, context, num_pages))
        query = torch.randn(batch, args.heads, args.head_dim).to(torch.bfloat16)
        times = []
        for _ in range(args.repeats + 1):
            total = 0.0
            for view in views:
                weights.sum()
                start = time.perf_counter()
                backend.attention(query, view, meta, scale)
                total += time.perf_counter() - start
            times.append(total)
        times = times[1:]  # the first pass warms the allocator
        kv_bytes = args.layers * batch * context * token_bytes
        rate = kv_bytes / min(times)
        print(
            f"{batch:5d} x {context:5d}    {statistics.median(times) * 1e3:8.2f} "
            f"({min(times) * 1e3:8.2f})    {kv_bytes / 1e6:7.1f} MB  {rate / 1e9:6.1f}"
            f"   {rate / memory_rate:8.1%}"
        )


if __name__ == "__main__":
    main()
