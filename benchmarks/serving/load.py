"""Serving benchmark: output tok/s, TTFT, TPOT and ITL of any OpenAI-compatible server.

Random-token prompts (ISL tokens each, from the model's own tokenizer), OSL output tokens with
ignore_eos and greedy sampling, streamed, at a fixed concurrency: the workload vLLM's
`vllm bench serve --dataset-name random` runs, so figures compare with ../shared/BENCHMARKING.md.
Against pdserve it also reads the decode workers' own step time over the run (their
``pdserve_step_seconds``, from the metrics pages ``/v1/workers`` lists) and prints TPOT beside
it: what the loop between two steps, and anything else a token waits for, adds to the step.
It prints the workload, then a figure a line (ms unless named otherwise), e.g. from SmolLM2 on 2
CPU cores (``--launch --isl 64 --osl 16 --num-prompts 8 --concurrency 4``)::

    ISL 64, OSL 16, 8 prompts, concurrency 4
      output_tok_s         46.2
      tpot_mean_ms         57.3
      decode_step_ms       57.3
      tpot_over_step       1.00

    python -m benchmarks.serving.load --base-url http://127.0.0.1:8000 [--isl 256 --osl 64
        --num-prompts 64 --concurrency 8]
    python -m benchmarks.serving.load --launch [pdserve up flags]   # starts pdserve up itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.harness import random_prompts, start_cluster
from common.metrics import parse_exposition
from common.model.default_model import resolve_model_path
from common.tokenizer import Tokenizer


@dataclass
class Result:
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    result = Result()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if not result.ttft:
                    result.ttft = now - start
                else:
                    result.token_times.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run(
    args, prompts: list[list[int]], model: str, extra: dict | None = None
) -> tuple[list[Result], float]:
    """Every prompt, ``--concurrency`` at a time; ``extra``: more request fields (a structured
    output, say)."""
    url = f"{args.base_url}/v1/completions"
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def limited(prompt: list[int]) -> Result:
            body = {
                "model": model, "prompt": prompt, "max_tokens": args.osl, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                **(extra or {}),
            }  # fmt: skip
            async with semaphore:
                return await one_request(client, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class DecodeSteps:
    """The decode workers' engine steps so far, all workers summed."""

    seconds: float
    count: int

    def __sub__(self, earlier: DecodeSteps) -> DecodeSteps:
        return DecodeSteps(self.seconds - earlier.seconds, self.count - earlier.count)


def decode_steps(base_url: str) -> DecodeSteps | None:
    """Every decode worker's ``pdserve_step_seconds`` sum and count, read from the metrics
    pages the router's ``/v1/workers`` lists; None from a server that lists none (not pdserve)."""
    try:
        listed = httpx.get(f"{base_url}/v1/workers", timeout=10)
        if listed.status_code != 200:
            return None
        workers = listed.json().get("decode", [])
        seconds, count = 0.0, 0
        for worker in workers:
            page = parse_exposition(httpx.get(worker["metrics_url"], timeout=10).text)
            seconds += page.get("pdserve_step_seconds_sum", 0.0)
            count += int(page.get("pdserve_step_seconds_count", 0.0))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return DecodeSteps(seconds, count) if workers else None


def report(results: list[Result], elapsed: float, args, steps: DecodeSteps | None = None) -> dict:
    good = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    output = sum(r.output_tokens for r in good)
    ttft = [r.ttft * 1e3 for r in good]
    itl = [t * 1e3 for r in good for t in r.token_times]
    tpot = [(sum(r.token_times) / len(r.token_times)) * 1e3 for r in good if r.token_times]
    figures = {
        "requests_ok": len(good),
        "errors": len(errors),
        "output_tok_s": output / elapsed,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "tpot_mean_ms": statistics.fmean(tpot) if tpot else float("nan"),
        "itl_p99_ms": percentile(itl, 0.99),
        "duration_s": elapsed,
    }
    if steps is not None and steps.count > 0:
        # The decode workers' mean step over the run, and TPOT against it.
        step_ms = steps.seconds / steps.count * 1e3
        figures["decode_step_ms"] = step_ms
        figures["tpot_over_step"] = figures["tpot_mean_ms"] / step_ms
    print(f"ISL {args.isl}, OSL {args.osl}, {args.num_prompts} prompts, concurrency "
          f"{args.concurrency}")  # fmt: skip
    for name, value in figures.items():
        print(f"  {name:<14} {value:10.{2 if name == 'tpot_over_step' else 1}f}")
    if errors:
        print(f"  first error: {errors[0]}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model folder (tokenizer and name)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--launch", action="store_true", help="start `pdserve up` first")
    args, up_flags = parser.parse_known_args()
    folder = resolve_model_path(args.model)
    prompts = random_prompts(args.num_prompts, args.isl, len(Tokenizer(folder)), args.seed)
    cluster = None
    if args.launch:
        port = int(args.base_url.rsplit(":", 1)[1])
        cluster = start_cluster(folder, *up_flags, port=port)
        cluster.wait_until_up()
    try:
        model = args.served_model_name or folder.name
        # One request first, so start-up costs (first forward, connections) are not measured.
        asyncio.run(run(argparse.Namespace(**{**vars(args), "concurrency": 1}), prompts[:1],
                        model))  # fmt: skip
        before = decode_steps(args.base_url)
        results, elapsed = asyncio.run(run(args, prompts, model))
        after = decode_steps(args.base_url)
        steps = after - before if after is not None and before is not None else None
        report(results, elapsed, args, steps)
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
