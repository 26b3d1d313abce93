"""FP8 KV cache against bf16 KV on the default model: greedy agreement and capacity.

32 chat prompts x 64 greedy tokens, once with a bf16 KV pool and once with an FP8 (e4m3, one
scale per token and head) pool; prints how many sequences come out identical, the share of
tokens generated before the first divergence, and how many tokens of KV each pool holds in
the same memory.

    python -m benchmarks.fp8_kv [--model PATH] [--memory 256MiB]
"""

from __future__ import annotations

import argparse
import itertools

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.engine.memory import parse_memory_size
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

TASKS = ["Explain", "Write a short poem about", "Give three facts about", "Describe"]
TOPICS = ["the moon", "photosynthesis", "the Roman empire", "volcanoes", "jazz music",
          "the water cycle", "honeybees", "the printing press"]  # fmt: skip


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"{task} {topic}."}])
        for task, topic in itertools.product(TASKS, TOPICS)
    ]


def run(
    args, kv_cache_dtype: str, prompts: list[list[int]], chunk: int = 2048
) -> tuple[list[list[int]], int]:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="bfloat16",
            cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.memory),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=1024),
        )
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    capacity = engine.pool.num_blocks * engine.kv_layout.block_size
    return engine.generate(prompts, params), capacity


def agreement(reference: list[list[int]], other: list[list[int]]) -> str:
    pairs = list(zip(reference, other, strict=True))
    total = sum(len(a) for a, _ in pairs)
    identical = sum(a == b for a, b in pairs)
    before_first = sum(
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in pairs
    )
    positional = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))
    return f"{identical:>7}/{len(pairs):<2}{before_first / total:>17.1%}{positional / total:>12.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--memory", type=parse_memory_size, default=parse_memory_size("256MiB"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from common.model.default_model import resolve_model_path

    tokenizer = Tokenizer(resolve_model_path(args.model))
    prompts = chat_prompts(tokenizer)
    reference, bf16_tokens = run(args, "auto", prompts)
    # The noise floor: the same bf16 run with other prefill chunks, hence other rounding.
    rechunked, _ = run(args, "auto", prompts, chunk=64)
    fp8, fp8_tokens = run(args, "fp8", prompts)
    print(f"{len(prompts)} chat prompts x {args.tokens} greedy tokens, bf16 weights")
    print(f"{'against bf16 KV':<28}{'identical':>10}{'before 1st diff':>17}{'positional':>12}")
    for name, tokens in (("bf16 KV, 64-token chunks", rechunked), ("fp8 KV", fp8)):
        print(f"{name:<28}{agreement(reference, tokens)}")
    print(f"fp8 sample:  {tokenizer.decode(fp8[0])[:120]!r}")
    print(f"bf16 sample: {tokenizer.decode(reference[0])[:120]!r}")
    print(f"KV tokens in {args.memory / 2**20:.0f} MiB: bf16 {bf16_tokens}, fp8 {fp8_tokens} "
          f"({fp8_tokens / bf16_tokens:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
