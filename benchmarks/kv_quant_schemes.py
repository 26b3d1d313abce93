"""Which 8-bit KV scheme answers like bf16: each candidate measured on the default model before
any kernel is written for it.

Every scheme runs the real engine with a bf16 KV pool behind an attention backend that rounds
keys and values the way the scheme would store them (scale, round, clamp, scale back) before
they reach the pool, and, for the rotated schemes, turns queries, keys and values by one
orthogonal Hadamard matrix per head (queries and keys after RoPE: every dot product is unchanged;
values are turned back on the way out). So each row differs from the bf16 reference only by the
scheme's rounding; the first row checks the simulation against the real FP8 pool.

Capacity is what the scheme's layout would hold in the same memory: data bytes plus scale bytes
per token and head, against bf16's.

    python -m benchmarks.kv_quant_schemes [--model PATH] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from benchmarks.fp8_kv import agreement, chat_prompts
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.engine.memory import parse_memory_size
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from kernels.interface import AttentionBackend

FP8_MAX = 448.0
INT8_MAX = 127.0


@dataclass(frozen=True)
class Scheme:
    name: str
    element: str  # "fp8" (e4m3) | "int8" | "bf16" (no rounding)
    rotate: bool = False
    scale_over: str = "head"  # "head": one per token and head; "token": one per token
    scale_bytes: int = 4  # 4: float32; 1: an 8-bit code of log2(scale) in 1/8 octaves

    def capacity(self, num_kv_heads: int, head_dim: int) -> float:
        """Tokens this layout holds in the memory of one bf16 token."""
        if self.element == "bf16":
            return 1.0
        scales = num_kv_heads if self.scale_over == "head" else 1
        return 2 * num_kv_heads * head_dim / (num_kv_heads * head_dim + scales * self.scale_bytes)


SCHEMES = [
    Scheme("fp8, scale per token+head (today)", "fp8"),
    Scheme("fp8 + Hadamard", "fp8", rotate=True),
    Scheme("int8, scale per token+head", "int8"),
    Scheme("int8 + Hadamard", "int8", rotate=True),
    Scheme("int8 + Hadamard, 1-byte log scale", "int8", rotate=True, scale_bytes=1),
    Scheme("int8 + Hadamard, fp16 scale", "int8", rotate=True, scale_bytes=2),
    Scheme("int8 + Hadamard, scale per token", "int8", rotate=True, scale_over="token"),
    Scheme("bf16 + Hadamard (rotation alone)", "bf16", rotate=True),
]


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"head_dim {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def round_like(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``x`` [N, heads, head_dim] as the scheme would give it back from its pages."""
    if scheme.element == "bf16":
        return x
    xf = x.float()
    dims = (-1,) if scheme.scale_over == "head" else (-2, -1)
    limit = FP8_MAX if scheme.element == "fp8" else INT8_MAX
    scale = xf.abs().amax(dims, keepdim=True).clamp(min=1e-12) / limit
    if scheme.scale_bytes == 1:  # rounded up to the next 1/8 octave: nothing clips
        scale = torch.exp2(torch.ceil(torch.log2(scale) * 8) / 8)
    elif scheme.scale_bytes == 2:  # float16, rounded up
        half = scale.half()
        up = torch.nextafter(half, torch.full_like(half, math.inf))
        scale = torch.where(half.float() < scale, up, half).float()
    scaled = xf / scale
    if scheme.element == "fp8":
        stored = scaled.clamp(-limit, limit).to(torch.float8_e4m3fn).float()
    else:
        stored = scaled.round().clamp(-limit, limit)
    return (stored * scale).to(x.dtype)


class RoundingBackend(AttentionBackend):
    """Stands in front of the engine's backend: what reaches the pool is what the scheme
    would have stored."""

    def __init__(self, inner: AttentionBackend, scheme: Scheme, head_dim: int) -> None:
        self.inner = inner
        self.name = f"{inner.name}+{scheme.name}"
        self.scheme = scheme
        self.h = hadamard(head_dim) if scheme.rotate else None

    def plan(self, meta):
        return self.inner.plan(meta)

    def _turn(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (x.float() @ h.to(x.device)).to(x.dtype)

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        if self.h is not None:
            key, value = self._turn(key, self.h), self._turn(value, self.h)
        key, value = round_like(key, self.scheme), round_like(value, self.scheme)
        self.inner.store_kv(key.contiguous(), value.contiguous(), cache, slot_mapping)

    def attention(self, query, cache, meta, softmax_scale):
        if self.h is None:
            return self.inner.attention(query, cache, meta, softmax_scale)
        out = self.inner.attention(self._turn(query, self.h), cache, meta, softmax_scale)
        return self._turn(out, self.h.T)


def run(args, prompts, kv_cache_dtype="auto", scheme: Scheme | None = None, chunk: int = 2048):
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="bfloat16",
            cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.memory),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=1024),
        )
    )
    config = engine.model_config
    if scheme is not None:
        engine.model.bind_kv(engine.pool, RoundingBackend(engine.backend, scheme, config.head_dim))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params), (config.num_kv_heads, config.head_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--memory", type=parse_memory_size, default=parse_memory_size("256MiB"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from common.model.default_model import resolve_model_path

    prompts = chat_prompts(Tokenizer(resolve_model_path(args.model)))
    reference, shape = run(args, prompts)
    print(f"{len(prompts)} chat prompts x {args.tokens} greedy tokens, bf16 weights; "
          f"KV heads x head_dim {shape[0]} x {shape[1]}")  # fmt: skip
    print(f"{'against bf16 KV':<40}{'identical':>10}{'before 1st diff':>17}{'positional':>12}"
          f"{'capacity':>10}")  # fmt: skip
    rows = [("bf16 KV, 64-token chunks (noise floor)", run(args, prompts, chunk=64)[0], 1.0)]
    rows.append(("fp8 pool (the real kernels)", run(args, prompts, "fp8")[0], None))
    for scheme in SCHEMES:
        tokens, _ = run(args, prompts, scheme=scheme)
        rows.append((scheme.name, tokens, scheme.capacity(*shape)))
    for name, tokens, capacity in rows:
        cap = f"{capacity:>9.3f}x" if capacity is not None else f"{'':>10}"
        identical, before_first, positional = agreement(reference, tokens)
        print(f"{name:<40}{identical:>7}/{len(prompts):<2}{before_first:>17.1%}"
              f"{positional:>12.1%}{cap}")  # fmt: skip


if __name__ == "__main__":
    main()
