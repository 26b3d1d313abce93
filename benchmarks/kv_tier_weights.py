"""The router's tier weights, measured: what a prompt page held below a worker's pool saves
against computing it, on this box and model.

For each tier (host memory, then disk) it builds the one-process engine with only that tier
and a pool of ``--prompt-tokens`` tokens and a little more, computes a prompt of that many
random tokens cold (timing the prefill: the compute time per token), pushes its pages out of
the pool with other prompts, then serves it again and reads the restore's time from
``pdserve_kv_tier_restore_seconds`` (the mover's copy of every page; the pages per restore from
``pdserve_kv_tier_hits_total``)::

    weight(tier) = 1 - restore seconds per token / compute seconds per token

which is what a page there counts for in the router's prefix score against one in the pool
(``--kv-host-hit-weight``, ``--kv-disk-hit-weight``; ``router/policy.py``). The disk's blocks
were written moments before, so they are read from the kernel's page cache when memory allows:
a cold disk weighs less. It prints the box, each tier's figures and the router flags::

    python -m benchmarks.kv_tier_weights [--model DIR] [--prompt-tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import re
import tempfile
import time
from pathlib import Path

from prometheus_client import REGISTRY

from benchmarks.harness import random_prompts
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams

PAGE_SIZE = 16


def box() -> str:
    flags = sorted(set(re.findall(r"\b(avx512\w*|amx\w*)", Path("/proc/cpuinfo").read_text())))
    return f"{platform.processor() or platform.machine()}, flags: {' '.join(flags) or 'none'}"


def build(model: str, prompt_tokens: int, host_bytes: int, disk_dir: str | None) -> LLMEngine:
    pages = (prompt_tokens + 64) // PAGE_SIZE + 2
    return LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(
                page_size=PAGE_SIZE,
                num_pages=pages,
                kv_offloading_size=host_bytes,
                kv_offloading_dir=disk_dir,
            ),
            scheduler=SchedulerConfig(max_model_len=prompt_tokens + 64),
        )
    )


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def measure(engine: LLMEngine, tier: str, prompt_tokens: int, repeats: int, seed: int):
    """(compute seconds per token, restore seconds per token) over ``repeats`` prompts."""
    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    compute = restore = 0.0
    for repeat in range(repeats):
        prompt, filler = random_prompts(2, prompt_tokens + 1, vocab, seed + repeat)
        started = time.perf_counter()
        engine.generate([prompt], one)
        compute += (time.perf_counter() - started) / prompt_tokens
        engine.generate([filler], one)  # the prompt's pages leave the pool
        assert engine.tiers is not None
        engine.tiers.flush()
        seconds = sample("pdserve_kv_tier_restore_seconds_sum")
        hits = sample("pdserve_kv_tier_hits_total", {"tier": tier})
        engine.generate([prompt], one)
        pages = sample("pdserve_kv_tier_hits_total", {"tier": tier}) - hits
        if pages < prompt_tokens // PAGE_SIZE // 2:  # the pool may keep a few of the first
            raise RuntimeError(f"only {pages:.0f} pages came back from the {tier} tier")
        restore += (sample("pdserve_kv_tier_restore_seconds_sum") - seconds) / (pages * PAGE_SIZE)
    return compute / repeats, restore / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = str(resolve_model_path(args.model))
    print(f"box: {box()}")
    weights = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-") as directory:
        for tier, host_bytes, disk_dir in (("host", 1 << 30, None), ("disk", 0, directory)):
            engine = build(model, args.prompt_tokens, host_bytes, disk_dir)
            engine.generate([[1] * 32], SamplingParams(max_tokens=1))  # warm up
            compute, restore = measure(engine, tier, args.prompt_tokens, args.repeats, seed=7)
            engine.close()
            weights[tier] = max(0.0, 1.0 - restore / compute)
            print(
                f"{tier:>5}: compute {compute * 1e6:8.1f} us/token, restore "
                f"{restore * 1e6:7.2f} us/token, weight {weights[tier]:.3f}"
            )
    print(
        f"router flags: --kv-host-hit-weight {weights['host']:.2f} "
        f"--kv-disk-hit-weight {weights['disk']:.2f}"
    )


if __name__ == "__main__":
    main()
