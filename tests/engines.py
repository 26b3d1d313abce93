"""One builder for the one-process engines the tests run: every knob a test turns, by name.

The defaults are a small CPU engine: float32, a fixed pool of 256 pages of 16 tokens (no memory
planning; ``num_pages=None`` plans the pool, from ``kv_cache_memory`` bytes where given),
prefix caching on, 256-token steps (the CPU engine's own default), prompts up to 512 tokens, no
speculation, the default kernels, decode steps one at a time (no async scheduling, as on any
CPU), a one-process engine (``role`` None; "prefill" or "decode" for a worker's).
A test passes only what it changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from common.engine.llm_engine import LLMEngine


def build_engine(
    folder: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
    num_pages: int | None = 256,
    kv_cache_memory: int | None = None,
    page_size: int = 16,
    prefix_caching: bool = True,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 256,
    max_model_len: int = 512,
    speculative: SpeculativeConfig | None = None,
    deterministic: bool = False,
    enforce_eager: bool = False,
    async_scheduling: bool | None = None,
    role: str | None = None,
    lora: LoraConfig | None = None,
    kv_offloading_size: int = 0,
    kv_offloading_dir: str | Path | None = None,
    kv_offloading_disk_size: int = 1 << 30,
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype=dtype,
            device=device,
            cache=CacheConfig(
                page_size=page_size,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=prefix_caching,
                num_pages=num_pages,
                kv_cache_memory=kv_cache_memory,
                kv_offloading_size=kv_offloading_size,
                kv_offloading_dir=str(kv_offloading_dir) if kv_offloading_dir else None,
                kv_offloading_disk_size=kv_offloading_disk_size,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                async_scheduling=async_scheduling,
            ),
            speculative=speculative or SpeculativeConfig(),
            enforce_eager=enforce_eager,
            enable_deterministic_inference=deterministic,
            lora=lora or LoraConfig(),
        ),
        role=role,
    )


def tp_engine_config(folder: str | Path, tp: int, **changes) -> EngineConfig:
    """The config of a tensor-parallel group's engine over ``tp`` ranks: float32 on the CPU, a
    fixed pool of 64 pages, small steps (the prompts arrive in several chunks, decodes ride
    beside prefills); ``changes`` over it, by field."""
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_pages=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=48, max_model_len=256),
        tensor_parallel_size=tp,
    )
    return dataclasses.replace(config, **changes)
