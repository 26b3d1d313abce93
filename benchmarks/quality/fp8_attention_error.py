"""How far 8-bit KV pages move the attention output from bf16 pages, per scheme.

Two schemes, as ``--kv-cache-dtype`` names them: ``fp8`` (e4m3, a float32 scale per token and
KV head) and ``int8`` (queries, keys and values turned by a Hadamard matrix as the model turns
them, then int8 with a one-byte scale; the output turned back). Keys and values go through the
backend's own ``store_kv`` (quantised as in serving) and are read back by its ``attention``.
The backend is the one the registry picks for the device: Triton on CUDA, the C kernels on a
CPU (``PDSERVE_ATTENTION_BACKEND`` overrides). For scale, the bf16 pages' own error against float32
pages is printed beside it.

Keys and values are synthetic but shaped like a trained model's: keys carry a few outlier
channels per head (as post-RoPE keys do, and these set the FP8 scale), values are Gaussian, and
queries are scaled so that the attention logits have a standard deviation near 2.

Three rows per shape (fp8 against bf16 pages, int8 against bf16, bf16 against fp32): max and
mean absolute error, the relative error over the batch and the worst (token, head) row's, e.g.
(the C kernels on a CPU)::

    llama3-8b decode             int8 vs bf16    2.34e-02  1.13e-03  1.73e-02  3.55e-02

    python -m benchmarks.quality.fp8_attention_error [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kernels.interface import (
    FP8_DTYPE,
    INT8_DTYPE,
    INT8_SCALE_DTYPE,
    AttentionBackend,
    AttentionMetadata,
    KVCacheView,
)
from kernels.kv_turn import hadamard_turns
from kernels.registry import get_attention_backend
from kernels.sizes import ceil_div

PAGE_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_seqs: int
    context: int  # tokens of context per sequence after the step
    query_len: int  # new tokens per sequence (1: decode)


SHAPES = [
    Shape("llama3-8b decode", 32, 8, 128, num_seqs=8, context=4096, query_len=1),
    Shape("llama3-8b prefill chunk", 32, 8, 128, num_seqs=1, context=2048, query_len=512),
    Shape("qwen2.5-0.5b decode", 14, 2, 64, num_seqs=8, context=8192, query_len=1),
    Shape("mistral-7b spec verify", 32, 8, 128, num_seqs=4, context=1024, query_len=5),
]


@dataclass(frozen=True)
class Errors:
    max_abs: float
    mean_abs: float
    relative: float  # ||error|| / ||output|| over the whole batch
    worst_row: float  # the largest such ratio of one (token, head) output vector

    @classmethod
    def between(cls, out: torch.Tensor, truth: torch.Tensor) -> Errors:
        out, truth = out.float(), truth.float()
        diff = out - truth
        rows = diff.norm(dim=-1) / truth.norm(dim=-1).clamp_min(1e-12)
        return cls(
            max_abs=diff.abs().max().item(),
            mean_abs=diff.abs().mean().item(),
            relative=(diff.norm() / truth.norm()).item(),
            worst_row=rows.max().item(),
        )

    def __str__(self) -> str:
        return (
            f"{self.max_abs:9.2e} {self.mean_abs:9.2e} {self.relative:9.2e} {self.worst_row:9.2e}"
        )


def synthetic_qkv(
    shape: Shape, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query [N, H, D], key and value [num_seqs * context, Hkv, D], all float32 on the CPU."""
    num_tokens = shape.num_seqs * shape.context
    kv_shape = (num_tokens, shape.num_kv_heads, shape.head_dim)
    channel_scale = torch.ones(shape.num_kv_heads, shape.head_dim)
    outliers = torch.randint(0, shape.head_dim, (shape.num_kv_heads, 4), generator=generator)
    channel_scale.scatter_(1, outliers, 4.0)
    key = torch.randn(kv_shape, generator=generator) * channel_scale
    value = torch.randn(kv_shape, generator=generator)
    # A logit's variance is query_std^2 * |channel_scale|^2 / head_dim: aim for a std of 2.
    query_std = 2.0 * shape.head_dim**0.5 / channel_scale.norm(dim=-1).mean().item()
    query_shape = (shape.num_seqs * shape.query_len, shape.num_heads, shape.head_dim)
    query = torch.randn(query_shape, generator=generator) * query_std
    return query, key, value


def metadata(shape: Shape, device: torch.device, generator: torch.Generator) -> AttentionMetadata:
    """Each sequence on its own pages, spread over the pool in random order."""
    pages_per_seq = ceil_div(shape.context, PAGE_SIZE)
    pages = torch.randperm(shape.num_seqs * pages_per_seq, generator=generator)
    tables = pages.view(shape.num_seqs, pages_per_seq).to(torch.int32)
    positions = torch.arange(shape.context)
    slots = tables.long()[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    query_start_loc = torch.arange(shape.num_seqs + 1, dtype=torch.int32) * shape.query_len
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.full((shape.num_seqs,), shape.context, dtype=torch.int32, device=device),
        page_tables=tables.to(device),
        # Every context slot: the whole context is stored in one call.
        slot_mapping=slots.reshape(-1).to(device),
        max_query_len=shape.query_len,
        max_seq_len=shape.context,
    )


def attend(
    backend: AttentionBackend,
    shape: Shape,
    meta: AttentionMetadata,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> torch.Tensor:
    """Store the context in a fresh pool of ``kv_dtype`` and attend to it in ``dtype``; int8
    pages hold turned keys and values, as the model stores them."""
    device = meta.seq_lens.device
    query, key, value = (x.to(device=device, dtype=dtype) for x in qkv)
    num_pages = meta.page_tables.numel()
    page_shape = (num_pages, 1, 2, PAGE_SIZE, shape.num_kv_heads)
    pages = torch.zeros((*page_shape, shape.head_dim), dtype=kv_dtype, device=device)
    scale_dtype = {FP8_DTYPE: torch.float32, INT8_DTYPE: INT8_SCALE_DTYPE}.get(kv_dtype)
    if scale_dtype is not None:
        scales = torch.ones(page_shape, dtype=scale_dtype, device=device)
        cache = KVCacheView(pages[:, 0, 0], pages[:, 0, 1], scales[:, 0, 0], scales[:, 0, 1])
    else:
        cache = KVCacheView(pages[:, 0, 0], pages[:, 0, 1])
    if kv_dtype != INT8_DTYPE:
        backend.store_kv(key, value, cache, meta.slot_mapping)
        return backend.attention(query, cache, meta, shape.head_dim**-0.5)
    query_turn, kv_turn = hadamard_turns(shape.head_dim, dtype, device)
    with torch.no_grad():
        backend.store_kv(kv_turn(key), kv_turn(value), cache, meta.slot_mapping)
        out = backend.attention(query_turn(query), cache, meta, shape.head_dim**-0.5)
        return query_turn(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = get_attention_backend(device)
    print(f"attention backend: {backend.name} on {device}; KV page size {PAGE_SIZE}")
    print("errors of the attention output (bf16 queries):")
    header = f"{'shape':28} {'KV':14} {'max abs':>9} {'mean abs':>9} {'rel':>9} {'worst row':>9}"
    print(header)
    print("-" * len(header))
    for shape in SHAPES:
        generator = torch.Generator().manual_seed(args.seed)
        qkv = synthetic_qkv(shape, generator)
        meta = metadata(shape, device, generator)
        exact = attend(backend, shape, meta, qkv, torch.float32, torch.float32)
        bf16 = attend(backend, shape, meta, qkv, torch.bfloat16, torch.bfloat16)
        fp8 = attend(backend, shape, meta, qkv, torch.bfloat16, FP8_DTYPE)
        int8 = attend(backend, shape, meta, qkv, torch.bfloat16, INT8_DTYPE)
        print(f"{shape.name:28} {'fp8 vs bf16':14} {Errors.between(fp8, bf16)}")
        print(f"{'':28} {'int8 vs bf16':14} {Errors.between(int8, bf16)}")
        print(f"{'':28} {'bf16 vs fp32':14} {Errors.between(bf16, exact)}")


if __name__ == "__main__":
    main()
