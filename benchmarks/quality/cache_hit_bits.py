"""Does a prefix-cache hit alone change a greedy answer? One engine in one process, the same
prompts sent twice, one request at a time: the first pass computes every prompt token, the
second finds each prompt's full pages in the prefix cache and prefills only what follows. The
control runs the same with prefix caching off (both passes compute everything, in the same
chunks). Prints, per configuration, how many answers came out bit for bit equal (tokens and
logprobs) and how many with the same tokens, a line each::

    deterministic=False prefix_caching=False: cached tokens on the repeat [0, 0, 0, 0, 0, 0]; bit
    for bit 6/6, same tokens 6/6

(wrapped here).

    python -m benchmarks.quality.cache_hit_bits [--model FOLDER] [--tokens 48] [--deterministic]
"""

from __future__ import annotations

import argparse

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import ensure_default_model
from common.sampling_params import SamplingParams

PROMPT_LENGTHS = (40, 75, 130, 200, 300, 450)


def answers(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt's (token ids, logprobs), one request at a time, and its cached tokens."""
    out = []
    for i, prompt in enumerate(prompts):
        request_id = engine.add_request(prompt, params, request_id=f"r{i}")
        samples, cached = [], 0
        while engine.has_unfinished:
            for output in engine.step():
                if output.request_id == request_id:
                    samples.extend(output.new_samples)
                    cached = output.num_cached_tokens
        out.append(
            ((tuple(s.token_id for s in samples), tuple(s.logprob for s in samples)), cached)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    folder = args.model or ensure_default_model(progress=False)
    generator = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(100, 40000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=1, temperature=0.0)
    for caching in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=str(folder),
                dtype=args.dtype,
                cache=CacheConfig(enable_prefix_caching=caching, num_pages=256),
                scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=512),
                enable_deterministic_inference=args.deterministic,
            )
        )
        first = answers(engine, prompts, params)
        again = answers(engine, prompts, params)
        bits = sum(a[0] == b[0] for a, b in zip(first, again, strict=True))
        tokens = sum(a[0][0] == b[0][0] for a, b in zip(first, again, strict=True))
        print(
            f"deterministic={args.deterministic} prefix_caching={caching}: cached tokens on the "
            f"repeat {[cached for _, cached in again]}; bit for bit {bits}/{len(prompts)}, "
            f"same tokens {tokens}/{len(prompts)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
