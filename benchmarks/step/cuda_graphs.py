"""Decode speed with CUDA graphs against eager steps, in one process on one GPU.

Two engines on the same model and settings, one with ``--enforce-eager``: for each batch size,
that many requests (random 64-token prompts, 128 output tokens, greedy, ignore_eos) are
prefilled, then their decode steps are timed, alternating the engines twice and keeping each
one's faster run. Prints ms per decode step and output tokens/s, and the graphs' speed-up. The
graph engine runs twice, with each step launched before the last one's tokens are read (the
default, ``--async-scheduling``) and with steps taken one at a time, whose difference is the
time the GPU waited on the host between steps. A row per batch size: batch, ms per step eager,
with graphs one step at a time and with graphs launched ahead, the graphs' speed-up, and eager
and graph tokens/s; e.g. batch 8 on an H200, SmolLM2's shape (columns squeezed here)::

    8  34.30  1.57  1.15  29.83x  233  6957

    python -m benchmarks.step.cuda_graphs [--model FOLDER] [--batch-sizes 1,8,32,64]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.harness import random_prompts
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

PROMPT_LEN, OUTPUT_LEN = 64, 128


def build(args: argparse.Namespace, eager: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cuda",
            cache=CacheConfig(kv_cache_memory=args.kv_cache_gib << 30),
            scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_model_len=1024),
            enforce_eager=eager,
        )
    )


def decode_steps(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, int]:
    """Prefill ``prompts`` together, then time their decode steps: (seconds per step, steps)."""
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(prompt, params) for prompt in prompts}
    started: set[str] = set()
    while started != ids:  # prefill: every request has its first token
        started |= {out.request_id for out in engine.step() if out.new_samples}
    torch.cuda.synchronize()
    began, steps = time.perf_counter(), 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="each engine's KV pool")
    args = parser.parse_args()
    args.batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    if not torch.cuda.is_available():
        print("benchmarks.step.cuda_graphs compares decode steps on a CUDA GPU; none is visible.")
        return 0
    eager_engine, graph_engine = build(args, eager=True), build(args, eager=False)
    graphs = graph_engine.runner.graphs
    assert graphs is not None, "the graph engine captured no CUDA graphs"
    # (engine, whether its steps are launched ahead) by column; a run ends with nothing ahead.
    variants = {
        "eager": (eager_engine, True),
        "graphs 1 by 1": (graph_engine, False),
        "graphs": (graph_engine, True),
    }
    vocab = eager_engine.model_config.vocab_size
    print(
        f"device: {torch.cuda.get_device_name()}; {eager_engine.model_config.architecture}, "
        f"{args.dtype}; {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens; "
        f"graphs for batches of {graphs.sizes}; ms per decode step, steps launched ahead "
        "unless taken 1 by 1"
    )
    columns = ("batch", *variants, "speed-up", "eager tok/s", "graphs tok/s")
    print("  " + "  ".join(f"{name:>14}" for name in columns))
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, PROMPT_LEN, vocab, seed=batch)
        best: dict[str, float] = {}
        for _ in range(2):
            for name, (engine, ahead) in variants.items():
                engine.steps_ahead = ahead
                per_step, _ = decode_steps(engine, prompts)
                best[name] = min(best.get(name, float("inf")), per_step)
        eager, graphed = best["eager"], best["graphs"]
        cells = (
            f"{batch}",
            *(f"{best[name] * 1e3:.2f}" for name in variants),
            f"{eager / graphed:.2f}x",
            f"{batch / eager:.0f}",
            f"{batch / graphed:.0f}",
        )
        print("  " + "  ".join(f"{cell:>14}" for cell in cells))
    print(f"  graph replays: {graphs.replays}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
