"""Overload: requests offered at 1x, 2x and 5x of what a cluster serves, and what becomes of them.

`pdserve up` (one prefill and one decode worker) serves a small model with random weights (a
Llama of ``--layers`` layers of ``--hidden`` units and the default model's tokenizer: big enough
that the workers, not the router, are what saturates, small enough for a CPU). First its
capacity: the requests a second that ``--concurrency`` clients in a closed loop get answered.
Then, per level N, requests arrive as a Poisson process at N times that rate for ``--duration``
seconds, each ``--isl`` random prompt tokens asking for ``--osl`` tokens, streamed. Each one is:

- refused: a 429 (with how long the refusal took to come back: it should be at once);
- accepted: anything else; completed when its stream ran to its end, good when its TTFT and
  its TPOT were within the SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``).

Goodput is good requests per second of arrivals; each level's is printed as a ratio to 1x's (the
goal at 5x: at least 0.9). The cluster runs with admission (``--max-queue-delay``: a request
predicted to wait longer is refused at once; ``--max-inflight-per-worker``: beyond it requests
wait in the router, so a decode batch stays the size that keeps TPOT), and with
``--without-admission`` the same levels run again with both off, for contrast. One line a level,
e.g. on the 2-core AVX-512 Xeon (the defaults)::

    capacity 9.7 req/s (ISL 128, OSL 16, concurrency 32; SLO TTFT 3000 ms TPOT 300 ms)
    admission (--max-queue-delay 1.5 --max-inflight-per-worker 16)
    1x: accepted 164 completed 164 refused 40 goodput_ratio 1.00 (good 8.2/s, refused in 3/6 ms)
    5x: accepted 197 completed 197 refused 757 goodput_ratio 1.20 (good 9.8/s, refused in 3/10 ms)
    without admission
    5x: accepted 954 completed 954 refused 0 goodput_ratio 0.34 (good 3.5/s, refused in - ms)

    python -m benchmarks.serving.overload [--levels 1,2,5] [--duration 20] [--without-admission]

The capacity is measured once, admission off (the cluster's own), and every level of either run
offers a multiple of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness import pdserve_up, random_prompts, save_random_model
from common.model.default_model import resolve_model_path

# One prefill and one decode worker (pdserve up's default), the model served by one name.
CLUSTER_FLAGS = ("--served-model-name", "overload", "--max-model-len", "2048")


@dataclass
class Outcome:
    status: int = 0  # the HTTP status; 0: the connection failed
    seconds: float = 0.0  # until the answer ended (a refusal: until it came back)
    ttft: float | None = None
    tpot: float | None = None
    completed: bool = False


async def ask(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    outcome = Outcome()
    start = time.perf_counter()
    tokens, first, last = 0, None, start
    try:
        async with client.stream("POST", url, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.seconds = time.perf_counter() - start
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    break
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first if first is not None else last
                    tokens += 1
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    outcome.completed = True
    except httpx.HTTPError:
        outcome.status = outcome.status or 0
    outcome.seconds = time.perf_counter() - start
    if first is not None:
        outcome.ttft = first - start
        outcome.tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return outcome


def bodies(count: int, args: argparse.Namespace, seed: int) -> list[dict]:
    """Distinct random prompts: no prefix-cache hit makes one request cheaper than another."""
    prompts = random_prompts(count, args.isl, args.vocab_size, seed)
    return [
        {"model": "overload", "prompt": prompt, "max_tokens": args.osl, "temperature": 0,
         "stream": True, "ignore_eos": True}
        for prompt in prompts
    ]  # fmt: skip


async def capacity(base: str, args: argparse.Namespace) -> float:
    """Requests a second answered to ``--concurrency`` clients asking one after another (a
    refused one asks again a moment later): enough clients to keep every worker's batch full,
    so the rate is what the cluster serves, not what the clients ask."""
    url = f"{base}/v1/completions"
    queue = bodies(args.concurrency * 400, args, seed=1)
    done = 0
    deadline = time.perf_counter() + args.calibration

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline and queue:
            outcome = await ask(client, url, queue.pop())
            if outcome.completed:
                done += 1
            elif outcome.status == 429:
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=600) as client:
        await ask(client, url, queue.pop())  # warm
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
        return done / (time.perf_counter() - started)


async def offer(base: str, rate: float, args: argparse.Namespace, seed: int) -> list[Outcome]:
    """Poisson arrivals at ``rate`` a second for ``--duration`` seconds; every answer awaited."""
    url = f"{base}/v1/completions"
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = []
        queue = bodies(int(rate * args.duration * 1.5) + 16, args, seed=seed)
        started = time.perf_counter()
        at = 0.0
        while queue:
            at += rng.expovariate(rate)
            if at > args.duration:
                break
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            tasks.append(asyncio.create_task(ask(client, url, queue.pop())))
        return await asyncio.gather(*tasks)


def summary(outcomes: list[Outcome], args: argparse.Namespace) -> tuple[int, int, int, float, str]:
    refused = [o for o in outcomes if o.status == 429]
    accepted = [o for o in outcomes if o.status != 429]
    completed = [o for o in accepted if o.completed]
    good = [
        o for o in completed
        if o.ttft is not None and o.ttft * 1e3 <= args.slo_ttft_ms
        and o.tpot is not None and o.tpot * 1e3 <= args.slo_tpot_ms
    ]  # fmt: skip
    refusal = "-"
    if refused:
        times = sorted(o.seconds * 1e3 for o in refused)
        refusal = f"{statistics.median(times):.0f}/{times[int(0.99 * (len(times) - 1))]:.0f}"
    return len(accepted), len(completed), len(refused), len(good) / args.duration, refusal


def build_model(folder: Path, args: argparse.Namespace) -> Path:
    import torch
    from transformers import LlamaConfig

    tokenizer = resolve_model_path(None)
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 192), max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    return save_random_model(config, folder, torch.bfloat16, tokenizer_from=tokenizer)


def measure_capacity(model: Path, flags: list[str], args: argparse.Namespace) -> float:
    """The cluster's own capacity, admission off: what the levels are multiples of."""
    with pdserve_up(model, *CLUSTER_FLAGS, *flags) as cluster:
        return asyncio.run(capacity(cluster.base_url, args))


def run_levels(
    model: Path, rate: float, flags: list[str], label: str, args: argparse.Namespace
) -> None:
    print(label, flush=True)
    with pdserve_up(model, *CLUSTER_FLAGS, *flags) as cluster:
        baseline = None
        for level in args.levels:
            outcomes = asyncio.run(offer(cluster.base_url, level * rate, args, seed=100 + level))
            accepted, completed, refused, goodput, refusal = summary(outcomes, args)
            baseline = goodput if baseline is None else baseline
            ratio = goodput / baseline if baseline else 0.0
            print(
                f"{level:g}x: accepted {accepted} completed {completed} refused {refused} "
                f"goodput_ratio {ratio:.2f} (good {goodput:.1f}/s, refused in {refusal} ms)",
                flush=True,
            )
            time.sleep(args.settle)  # what was accepted drains before the next level


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--levels", default="1,2,5", help="offered load, as multiples of capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals a level")
    p.add_argument("--calibration", type=float, default=10.0, help="seconds of the capacity run")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between levels")
    p.add_argument("--concurrency", type=int, default=32, help="clients of the capacity run")
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=16)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=49152, help="the default tokenizer's")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--max-queue-delay", type=float, default=1.5)
    p.add_argument("--max-inflight-per-worker", type=int, default=16)
    p.add_argument("--without-admission", action="store_true", help="also run with it off")
    p.add_argument("--pdserve-args", default="", help="more `pdserve up` flags")
    args = p.parse_args(argv)
    args.levels = [float(level) for level in args.levels.split(",")]
    extra = args.pdserve_args.split()
    with tempfile.TemporaryDirectory(prefix="pdserve-overload-") as tmp:
        model = build_model(Path(tmp) / "overload", args)
        rate = measure_capacity(model, extra, args)
        print(
            f"capacity {rate:.1f} req/s (ISL {args.isl}, OSL {args.osl}, concurrency "
            f"{args.concurrency}; SLO TTFT {args.slo_ttft_ms:g} ms TPOT {args.slo_tpot_ms:g} ms)",
            flush=True,
        )
        admission = ["--max-queue-delay", str(args.max_queue_delay),
                     "--max-inflight-per-worker", str(args.max_inflight_per_worker)]  # fmt: skip
        run_levels(model, rate, admission + extra, f"admission ({' '.join(admission)})", args)
        if args.without_admission:
            run_levels(model, rate, extra, "without admission", args)


if __name__ == "__main__":
    main()
