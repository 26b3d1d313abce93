"""``multiturn --cluster``: returning conversations through a router, one prefill and one decode
worker, with and without prefix fetches.

The conversations are those of the engine mode (a system prompt of their own, turns coming
back round-robin with their whole history), sent as token ids to ``/v1/completions`` and
streamed, so the time to first token is the client's. Two clusters are up at once, one with
prefix fetches and one without, and each request goes to one and then the other, one at a
time: the box's load (shared, here) falls on both alike. The prefill worker has a host tier
(``--host-gib``) below a pool sized for a quarter of the conversations; the decode worker has
the same pool and no tier. A conversation's first turn is long and goes to the prefill worker;
a returning turn's uncached part (the last reply and the new message) is short, so the router
has the decode worker prefill it (``--remote-prefill-min-tokens``, 128 by default as `pdserve
up` sets it without a GPU; past the second turn the uncached part, two replies and two
messages, is longer than that, and goes to the prefill worker unless it is raised to 256):
without prefix fetches it computes the whole history, with them it fetches the pages
the prefill worker holds (by now mostly in its host tier) and computes the rest.

The replies in a history are stand-ins of the reply's length (the API answers text, not token
ids); the prefill worker never saw a reply either way, so what is cached where is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from benchmarks.harness import free_port_pair, random_prompts, stop_process
from common.metrics import parse_exposition

PAGE_SIZE = 16
STARTUP_TIMEOUT_S = 600.0

Turn = tuple[float, int, int]  # TTFT s, prompt tokens, cached prompt tokens


def kv_bytes_per_token(model: str) -> int:
    """bf16 K and V of every layer, for one token."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * 2


def log_tails(log_dir: Path) -> str:
    return "\n".join(f"{log.name}: {log.read_text()[-1500:]}" for log in log_dir.glob("*.log"))


@contextmanager
def cluster(args: argparse.Namespace, prefix_fetch: bool, pool_tokens: int, log_dir: Path):
    """A router, a prefill worker with a host tier and a decode worker without, as processes;
    yields the router's base URL and the decode worker's metrics URL."""
    port = free_port_pair()
    control = f"tcp://127.0.0.1:{port + 1}"
    final_context = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    max_len = str(final_context + PAGE_SIZE)
    pool = f"{pool_tokens * kv_bytes_per_token(args.model) // 1024}KiB"
    worker = ["--router", control, "--model", args.model, "--dtype", "bfloat16", "--max-model-len",
              max_len, "--kv-cache-memory", pool, "--log-level", "WARNING"]  # fmt: skip
    commands = {
        "router": ["router", "--port", str(port), "--control", control, "--model", args.model,
                   "--max-model-len", max_len, "--log-level", "warning",
                   "--remote-prefill-min-tokens", str(args.remote_prefill_min_tokens),
                   "--prefix-fetch" if prefix_fetch else "--no-prefix-fetch"],
        "prefill": ["prefill_worker", *worker, "--worker-id", "prefill-0",
                    "--kv-offloading-size", str(args.host_gib)],
        "decode": ["decode_worker", *worker, "--worker-id", "decode-0"],
    }  # fmt: skip
    processes = []
    try:
        for name, (module, *rest) in commands.items():
            log = open(log_dir / f"{name}-{prefix_fetch}.log", "w")  # noqa: SIM115
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *rest],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ},
                )
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if any(p.poll() is not None for p in processes):
                raise RuntimeError(f"a process exited:\n{log_tails(log_dir)}")
            try:
                workers = httpx.get(f"{base}/v1/workers", timeout=5).json()
                if workers.get("prefill") and workers.get("decode"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not up in time:\n{log_tails(log_dir)}")
            time.sleep(0.5)
        yield base, workers["decode"][0]["metrics_url"]
    finally:
        for process in reversed(processes):
            stop_process(process, 60)


def ttft_of(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """A streamed completion of ``prompt``: seconds to its first token, and the cached prompt
    tokens its usage reports."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    ttft: float | None = None
    cached = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert ttft is not None, "no token came"
    return ttft, cached


def converse(bases: list[str], args: argparse.Namespace, vocab: int) -> list[list[Turn]]:
    """Every returning turn, round-robin, one request at a time, to each cluster in turn (the
    same conversations to each, so that the box's load falls on both alike): for each cluster,
    (TTFT s, prompt tokens, cached tokens) of each returning turn."""
    name = Path(args.model).name
    histories = random_prompts(args.conversations, args.system_tokens, vocab, seed=1)
    returning: list[list[Turn]] = [[] for _ in bases]
    for turn in range(args.turns):
        messages = random_prompts(args.conversations, args.user_tokens, vocab, seed=100 + turn)
        replies = random_prompts(args.conversations, args.reply_tokens, vocab, seed=200 + turn)
        for index, history in enumerate(histories):
            prompt = history + messages[index]
            for base, turns in zip(bases, returning, strict=True):
                ttft, cached = ttft_of(base, name, prompt, args.reply_tokens)
                if turn > 0:
                    turns.append((ttft, len(prompt), cached))
            histories[index] = prompt + replies[index]
    return returning


def run(args: argparse.Namespace, vocab: int, pool_tokens: int, box: str) -> None:
    print(f"box: {box}")
    print(
        f"cluster: router + 1 prefill worker (host tier {args.host_gib} GiB) + 1 decode worker "
        f"(no tier), pools for {pool_tokens} tokens each; {args.conversations} conversations x "
        f"{args.turns} turns: system {args.system_tokens}, user {args.user_tokens}, reply "
        f"{args.reply_tokens} tokens; --remote-prefill-min-tokens {args.remote_prefill_min_tokens}"
    )
    print(
        f"{'returning turns':>24}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'cached':>7}  "
        f"{'fetched pages (pool/host/disk)':>30}  (ms; share of prompt tokens)"
    )
    names = ("without prefix fetch", "with prefix fetch")
    model = Path(args.model).name
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-multiturn-cluster-") as directory,
        ExitStack() as stack,
    ):
        up = [
            stack.enter_context(cluster(args, fetch, pool_tokens, Path(directory)))
            for fetch in (False, True)
        ]
        for base, _ in up:
            # Warm both workers up (a long prompt through the prefill worker, a short one
            # prefilled on the decode worker).
            ttft_of(base, model, list(range(10, 10 + 4 * args.remote_prefill_min_tokens)), 2)
            ttft_of(base, model, list(range(20, 40)), 2)
        results = converse([base for base, _ in up], args, vocab)
        scrapes = [parse_exposition(httpx.get(url, timeout=10).text) for _, url in up]
    figures = []
    for name, turns, metrics in zip(names, results, scrapes, strict=True):
        fetched = [
            int(metrics.get(f'pdserve_kv_prefix_fetched_pages_total{{tier="{t}"}}', 0))
            for t in ("pool", "host", "disk")
        ]
        ttfts = sorted(t * 1000 for t, _, _ in turns)
        p50, p99 = statistics.median(ttfts), ttfts[round(0.99 * (len(ttfts) - 1))]
        cached = sum(c for _, _, c in turns) / sum(p for _, p, _ in turns)
        fetched_text = "/".join(str(n) for n in fetched)
        print(f"{name:>24}  {p50:9.1f}  {p99:9.1f}  {cached:7.1%}  {fetched_text:>30}")
        figures.append((p50, p99))
    (base_p50, base_p99), (p50, p99) = figures
    print(f"{'ratio with/without':>24}  {p50 / base_p50:8.2f}x  {p99 / base_p99:8.2f}x")
