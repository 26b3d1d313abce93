"""Where a CPU prefill step's time goes, part by part, on one pinned core.

Wraps each part of the module path with a wall-clock timer (the GEMMs, attention, the KV store,
the norms, RoPE, SiLU-and-multiply) and prints the fastest of a few steps of 512 and 2048 prompt
tokens (256-token prompts, as ``benchmarks.step.step`` times them), each part's share of the step,
and what is left (residual adds, Python per layer, embedding, head, sampling, bookkeeping).
The C kernels run through ctypes and torch.profiler does not see them; these timers do.
``--prompt-tokens 1792 --step-tokens 1792`` times one long prompt alone instead (W3's).

    python -m benchmarks.step.prefill_profile [--model PATH] [--core 0] [--repeats 4]
        [--prompt-tokens 256] [--step-tokens 512,2048]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks.harness import add_core_argument, pin_to_cores, random_prompts
from benchmarks.step.step import make_engine
from common.model import llama
from common.sampling_params import SamplingParams
from kernels.cpu import backend as cpu_backend
from kernels.cpu import linear as cpu_linear
from kernels.cpu import ops as cpu_ops

# (owner, method, part): every call of the method counts toward the part.
PARTS = (
    (cpu_linear.CpuLinear, "forward", "GEMMs"),
    (cpu_backend.CpuAttentionBackend, "attention", "attention"),
    (cpu_backend.CpuAttentionBackend, "store_kv", "KV store"),
    (cpu_ops.CpuRMSNorm, "forward", "RMSNorm"),
    (cpu_ops.CpuRMSNorm, "add_and_norm", "residual add + RMSNorm"),
    (cpu_ops.CpuRotaryApply, "forward", "RoPE"),
    (cpu_ops.CpuSiluAndMul, "forward", "SiLU-and-multiply"),
    (llama.LlamaForCausalLM, "forward", "model forward"),
)


@contextmanager
def timed_parts(seconds: collections.Counter) -> Iterator[None]:
    """Every PARTS method this tree has adds its wall time to ``seconds[part]`` while inside."""
    parts = [(owner, name, part) for owner, name, part in PARTS if hasattr(owner, name)]
    originals = [getattr(owner, name) for owner, name, _ in parts]

    def timer(method: Callable, part: str) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return run

    for (owner, name, part), method in zip(parts, originals, strict=True):
        setattr(owner, name, timer(method, part))
    try:
        yield
    finally:
        for (owner, name, _), method in zip(parts, originals, strict=True):
            setattr(owner, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_core_argument(parser)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt")
    parser.add_argument(
        "--step-tokens", default="512,2048", help="prompt tokens a step, a multiple of the above"
    )
    args = parser.parse_args()
    step_tokens = [int(n) for n in args.step_tokens.split(",")]
    if any(n % args.prompt_tokens or n > 2048 for n in step_tokens):
        parser.error("each --step-tokens is a multiple of --prompt-tokens, at most 2048")
    pin_to_cores({args.core})
    engine = make_engine(args, max_batched=2048, max_model_len=2048)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = engine.model_config.vocab_size
    seconds: collections.Counter = collections.Counter()
    with torch.inference_mode(), timed_parts(seconds):
        for num_tokens in step_tokens:
            best: tuple[float, dict[str, float]] | None = None
            for repeat in range(args.repeats + 1):
                # New prompts every step: a prompt seen before comes from the prefix cache.
                count, length = num_tokens // args.prompt_tokens, args.prompt_tokens
                for prompt in random_prompts(count, length, vocab, seed=7 * num_tokens + repeat):
                    engine.add_request(prompt, params)
                seconds.clear()
                start = time.perf_counter()
                engine.step()
                step = time.perf_counter() - start
                while engine.has_unfinished:
                    engine.step()
                if repeat and (best is None or step < best[0]):  # the first warms up
                    best = (step, dict(seconds))
            assert best is not None
            step, parts = best
            print(
                f"prefill {num_tokens} tokens: {step * 1e3:.1f} ms ({num_tokens / step:.0f} tok/s)"
            )
            inside = parts.pop("model forward", 0.0)
            for part, part_seconds in sorted(parts.items(), key=lambda item: -item[1]):
                print(f"  {part:24s} {part_seconds * 1e3:8.1f} ms {part_seconds / step:6.1%}")
            rest = inside - sum(parts.values())
            print(f"  {'rest of the forward':24s} {rest * 1e3:8.1f} ms {rest / step:6.1%}")
            outside = step - inside
            print(f"  {'outside the forward':24s} {outside * 1e3:8.1f} ms {outside / step:6.1%}")


if __name__ == "__main__":
    main()
