"""What serving LoRA adapters costs: W1 spread over 1, 4 and 16 adapters against the base alone.

`pdserve up` (one prefill and one decode worker, the default model unless ``--model`` names
another) serves every adapter from the start (``--enable-lora``, random rank ``--rank``
adapters on all seven targets, written as PEFT folders by ``write_random_adapter``, in a
temporary folder). W1 (random prompts of ``--isl`` tokens, ``--osl`` output tokens, greedy,
ignore_eos, streamed, ``--concurrency`` at a time) runs once with every request naming the base
model, then with the requests dealt round-robin over 1, 4 and 16 adapters; each case is run
``--rounds`` times, keeping its best output tok/s (and that run's TTFT). ``--max-loras`` is the
concurrency, so up to that many adapters no request waits for a slot (16 adapters do). One
line per case, e.g. SmolLM2-135M in bf16 on the 2-core AVX-512 Xeon (``--num-prompts 32
--rounds 2``, the box shared with other work)::

    base        out 135.5 tok/s  TTFT p50 1063 ms  p99 3815 ms
    1 adapter   out 120.9 tok/s (0.89x)  TTFT p50 1130 ms  p99 4306 ms
    4 adapters  out 114.7 tok/s (0.85x)  TTFT p50 1223 ms  p99 4464 ms
    16 adapters out 106.1 tok/s (0.78x)  TTFT p50 1420 ms  p99 4590 ms

    python -m benchmarks.serving.lora [--model FOLDER] [--rank 16] [--isl 256] [--osl 64]
        [--num-prompts 64] [--concurrency 8] [--rounds 1] [pdserve up flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from benchmarks.harness import pdserve_up, random_prompts
from benchmarks.serving.load import Result, one_request, percentile
from common.config import ModelConfig
from common.lora_adapters import COVERED_TARGETS
from common.model.default_model import resolve_model_path
from common.model.lora import target_shape
from common.tokenizer import Tokenizer

CASES = (0, 1, 4, 16)  # adapters W1 is spread over; 0: the base model alone


def write_random_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter folder of random rank-``rank`` LoRA weights on every covered target."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in COVERED_TARGETS:
            out_features, in_features = target_shape(config, target)
            owner = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=generator) * 0.01
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(COVERED_TARGETS),
        "bias": "none",
        "base_model_name_or_path": str(config.path),
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


async def run_spread(
    base_url: str, prompts: list[list[int]], models: list[str], args: argparse.Namespace
) -> tuple[list[Result], float]:
    """Every prompt under its model (round-robin over ``models``), ``--concurrency`` at a time."""
    url = f"{base_url}/v1/completions"
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def limited(index: int, prompt: list[int]) -> Result:
            body = {
                "model": models[index % len(models)], "prompt": prompt, "max_tokens": args.osl,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            async with semaphore:
                return await one_request(client, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def measure(
    base_url: str, prompts: list[list[int]], models: list[str], args: argparse.Namespace
) -> tuple[float, float, float]:
    """(output tok/s, TTFT p50 ms, TTFT p99 ms) of W1 over ``models``."""
    results, elapsed = asyncio.run(run_spread(base_url, prompts, models, args))
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    ttft = [r.ttft * 1e3 for r in results]
    tok_s = sum(r.output_tokens for r in results) / elapsed
    return tok_s, percentile(ttft, 0.5), percentile(ttft, 0.99)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None, help="model folder (default: pdserve up's)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--isl", type=int, default=256)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args, up_flags = p.parse_known_args(argv)
    folder = resolve_model_path(args.model)
    config = ModelConfig.from_pretrained(folder)
    vocab = len(Tokenizer(folder))
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as scratch:
        names = [f"adapter{i}" for i in range(max(CASES))]
        modules = [
            f"{name}={write_random_adapter(Path(scratch) / name, config, args.rank, i)}"
            for i, name in enumerate(names)
        ]
        flags = ["--enable-lora", "--lora-modules", *modules, "--max-loras",
                 str(args.concurrency), "--max-cpu-loras", str(len(names)), "--max-lora-rank",
                 str(args.rank), *up_flags]  # fmt: skip
        with pdserve_up(folder, *flags) as cluster:
            warm = random_prompts(args.concurrency, args.isl, vocab, args.seed + 100)
            measure(cluster.base_url, warm, [folder.name, *names], args)  # compile, connect
            print(f"W1: ISL {args.isl}, OSL {args.osl}, {args.num_prompts} prompts, "
                  f"concurrency {args.concurrency}, rank {args.rank}, {config.path.name}",
                  flush=True)  # fmt: skip
            base_tok_s = None
            for case in CASES:
                models = names[:case] if case else [folder.name]
                best = (0.0, 0.0, 0.0)
                for round_index in range(args.rounds):
                    # Fresh prompts each run: no prefix-cache hit from an earlier one.
                    seed = args.seed + 1000 * case + round_index
                    prompts = random_prompts(args.num_prompts, args.isl, vocab, seed)
                    best = max(best, measure(cluster.base_url, prompts, models, args))
                tok_s, p50, p99 = best
                base_tok_s = base_tok_s or tok_s
                label = "base" if case == 0 else f"{case} adapter{'s' if case > 1 else ''}"
                ratio = "" if case == 0 else f" ({tok_s / base_tok_s:.2f}x)"
                print(f"{label:<11} out {tok_s:.1f} tok/s{ratio}  TTFT p50 {p50:.0f} ms  "
                      f"p99 {p99:.0f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
