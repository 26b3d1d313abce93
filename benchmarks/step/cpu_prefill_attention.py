"""Prefill attention of the CPU path: SDPA against the AMX kernel, one layer's call per shape.

Long chunks of bf16 queries over bf16 pages attend on AMX tiles where the processor has them
(``kernels/cpu/prefill_attention.c``), and in SDPA's blocked kernel elsewhere. This times both on
the same pages, on one pinned core, for whole prompts of 256 to 2048 tokens, eight prompts of 256
side by side (one step of ``benchmarks.step.step``'s prefill), and chunks after a cached prefix. It
prints each path's milliseconds per layer, its rate in GFLOP/s (the causal half of the products
only), and the AMX kernel's speed-up.

    python -m benchmarks.step.cpu_prefill_attention [--core 0] [--heads 9] [--kv-heads 3]
        [--head-dim 64] [--repeats 5]

Shapes are SmolLM2-360M's (9 query heads over 3 KV heads of 64) unless given.
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.harness import add_core_argument, pin_to_cores
from kernels.cpu import library as cpu_library
from kernels.cpu.backend import CpuAttentionBackend
from kernels.interface import AttentionMetadata, KVCacheView
from kernels.sizes import ceil_div
from kernels.timing import best_seconds

PAGE_SIZE = 16
# (query rows of each chunk, its sequence's length, chunks side by side)
CASES = [
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


def chunk_metadata(query_len: int, seq_len: int, count: int) -> AttentionMetadata:
    """``count`` sequences of ``seq_len`` tokens, each prefilling its last ``query_len``, their
    pages handed out in random order."""
    per_seq = ceil_div(seq_len, PAGE_SIZE)
    tables = torch.randperm(count * per_seq).to(torch.int32).view(count, per_seq).contiguous()
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


def causal_gflop(query_len: int, seq_len: int, heads: int, head_dim: int) -> float:
    """Both products over the keys each row sees: 4 * head_dim FLOPs per (row, key, head)."""
    prefix = seq_len - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * head_dim * heads * pairs / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_core_argument(parser)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pin_to_cores({args.core})
    torch.manual_seed(0)

    backend = CpuAttentionBackend()
    amx = bool(cpu_library.load().pdserve_prefill_attention_available())
    print(
        f"{args.heads} query heads over {args.kv_heads} KV heads of {args.head_dim}, bf16 pages "
        f"of {PAGE_SIZE}; one core (#{args.core}); AMX kernel: {'yes' if amx else 'no AMX here'}"
    )
    print()
    print("chunk rows x context (x chunks)    SDPA ms  GFLOP/s     AMX ms  GFLOP/s   speed-up")
    scale = args.head_dim**-0.5
    for query_len, seq_len, count in CASES:
        meta = chunk_metadata(query_len, seq_len, count)
        num_pages = count * ceil_div(seq_len, PAGE_SIZE)
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


if __name__ == "__main__":
    main()
