"""Multi-turn conversations against a pool that holds a quarter of them, with and without the
KV tiers below it.

Each of ``--conversations`` conversations starts from a system prompt of its own
(``--system-tokens`` random tokens: an agent's instructions and documents) and comes back
``--turns`` times, each time with its whole history (every earlier message and reply) and a new
user message of ``--user-tokens``; the model answers ``--reply-tokens``. Conversations take
turns round-robin, one request at a time, so a conversation returns after every other one has
had a turn: by then the pool, sized for a quarter of the conversations' final contexts, has
turned over. It drives the engine a worker runs (``LLMEngine``, where the tiers live), without
the router and sockets, which add the same to both runs.

It reports, for the returning turns (every turn after the first), the time to first token p50
and p99 and where their prompt tokens came from (the pool's prefix cache, the host tier, the
disk tier, or computed), without tiers and with them, and the ratio of the two. Then the cost
when nothing is reused: ``--no-reuse-prompts`` distinct prompts served together, every page
they evict offloaded for nothing, out tok/s with the tiers against without. The figures are of
one run each, side by side; the box is named, since they depend on it (a run's figures:
docs/kv-tiers.md)::

    python -m benchmarks.serving.multiturn [--quick] [--tiers host|disk|host+disk]
        [--conversations 8] [--turns 4] [--system-tokens 1024] [--model DIR] [--cluster]

``--cluster`` serves the same conversations through a router, a prefill worker with a host
tier and a decode worker, and prints the returning turns' TTFT with and without prefix fetches
side by side (``multiturn_cluster.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY

from benchmarks.harness import random_prompts
from benchmarks.kv_tier_weights import box
from benchmarks.serving import multiturn_cluster
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams

PAGE_SIZE = 16
NO_REUSE_WAVE = 4
NO_REUSE_ROUNDS = 2  # each engine's no-reuse run, alternating with the other's


@dataclass(slots=True)
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int  # from the pool and the tiers
    host_tokens: int
    disk_tokens: int


def tier_hit_tokens(tier: str) -> int:
    pages = REGISTRY.get_sample_value("pdserve_kv_tier_hits_total", {"tier": tier}) or 0.0
    return int(pages) * PAGE_SIZE


def build(
    args: argparse.Namespace, tiers: str | None, disk_dir: str | None, pool_tokens: int
) -> LLMEngine:
    final_context = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    return LLMEngine(
        EngineConfig(
            model=args.model,
            cache=CacheConfig(
                page_size=PAGE_SIZE,
                num_pages=-(-pool_tokens // PAGE_SIZE),
                kv_offloading_size=args.host_gib << 30 if tiers and "host" in tiers else 0,
                kv_offloading_dir=disk_dir if tiers and "disk" in tiers else None,
            ),
            scheduler=SchedulerConfig(max_model_len=final_context + PAGE_SIZE),
        )
    )


def conversation_pool_tokens(args: argparse.Namespace) -> int:
    """A pool for a quarter of the conversations' final contexts (one at the least)."""
    final_context = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    return max(args.conversations * final_context // 4, final_context + PAGE_SIZE)


def no_reuse_pool_tokens(args: argparse.Namespace) -> int:
    """A pool for one and a half waves of the no-reuse prompts: each wave evicts (and, with
    tiers, offloads) the pages the wave before filed, and none is preempted."""
    return max(
        3 * NO_REUSE_WAVE * (args.no_reuse_tokens + args.reply_tokens + PAGE_SIZE) // 2,
        conversation_pool_tokens(args),
    )


def converse(engine: LLMEngine, args: argparse.Namespace) -> list[Turn]:
    """Every returning turn of every conversation, round-robin, one request at a time."""
    vocab = engine.model_config.vocab_size
    histories = random_prompts(args.conversations, args.system_tokens, vocab, seed=1)
    params = SamplingParams(max_tokens=args.reply_tokens, ignore_eos=True)
    returning: list[Turn] = []
    for turn in range(args.turns):
        messages = random_prompts(args.conversations, args.user_tokens, vocab, seed=100 + turn)
        for index, history in enumerate(histories):
            prompt = history + messages[index]
            host, disk = tier_hit_tokens("host"), tier_hit_tokens("disk")
            started = time.perf_counter()
            engine.add_request(prompt, params, request_id=f"c{index}-t{turn}")
            ttft: float | None = None
            reply: list[int] = []
            cached = 0
            while engine.has_unfinished:
                for output in engine.step():
                    if ttft is None and output.new_samples:
                        ttft = time.perf_counter() - started
                        cached = output.num_cached_tokens
                    reply.extend(sample.token_id for sample in output.new_samples)
            assert ttft is not None
            histories[index] = prompt + reply
            if turn > 0:
                returning.append(
                    Turn(
                        ttft,
                        len(prompt),
                        cached,
                        tier_hit_tokens("host") - host,
                        tier_hit_tokens("disk") - disk,
                    )
                )
    return returning


def no_reuse_tokens_per_s(engine: LLMEngine, args: argparse.Namespace, seed: int) -> float:
    """Out tok/s of distinct prompts served in waves of ``NO_REUSE_WAVE``: nothing is ever
    reused, and every wave evicts the pages of the one before."""
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(args.no_reuse_prompts, args.no_reuse_tokens, vocab, seed=seed)
    params = SamplingParams(max_tokens=args.reply_tokens, ignore_eos=True)
    started = time.perf_counter()
    generated = 0
    for start in range(0, len(prompts), NO_REUSE_WAVE):
        outputs = engine.generate(prompts[start : start + NO_REUSE_WAVE], params)
        generated += sum(len(tokens) for tokens in outputs)
    return generated / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def describe(name: str, turns: list[Turn]) -> tuple[float, float]:
    ttfts = [t.ttft_s * 1000 for t in turns]
    prompt = sum(t.prompt_tokens for t in turns)
    host = sum(t.host_tokens for t in turns)
    disk = sum(t.disk_tokens for t in turns)
    pool = sum(t.cached_tokens for t in turns) - host - disk
    p50, p99 = statistics.median(ttfts), percentile(ttfts, 0.99)
    print(
        f"{name:>22}  {p50:9.1f}  {p99:9.1f}   {pool / prompt:6.1%} {host / prompt:6.1%} "
        f"{disk / prompt:6.1%} {1 - (pool + host + disk) / prompt:9.1%}"
    )
    return p50, p99


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="4 conversations of 3 turns")
    parser.add_argument("--tiers", default="host", choices=["host", "disk", "host+disk"])
    parser.add_argument("--host-gib", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--no-reuse-prompts", type=int, default=16)
    parser.add_argument("--no-reuse-tokens", type=int, default=256)
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="router + 1 prefill + 1 decode worker: TTFT with and without prefix fetches",
    )
    parser.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=128,
        help="the router's, with --cluster (default: pdserve up's without a GPU)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.no_reuse_prompts = 4, 3, 8
    args.model = str(resolve_model_path(args.model))
    if args.cluster:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        multiturn_cluster.run(args, vocab, conversation_pool_tokens(args), box())
        return
    print(f"box: {box()}")
    final = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    print(
        f"{args.conversations} conversations x {args.turns} turns: system {args.system_tokens}, "
        f"user {args.user_tokens}, reply {args.reply_tokens} tokens (final context {final}); "
        f"pool for a quarter of them; tiers: {args.tiers}"
    )
    print(
        f"{'returning turns':>22}  {'TTFT p50':>9}  {'TTFT p99':>9}   "
        f"{'pool':>6} {'host':>6} {'disk':>6} {'computed':>9}  (ms; prompt tokens)"
    )
    results: dict[str, tuple[float, float]] = {}
    names = ("without tiers", f"with tiers ({args.tiers})")
    with tempfile.TemporaryDirectory(prefix="pdserve-multiturn-") as directory:
        for name, tiers in zip(names, (None, args.tiers), strict=True):
            engine = build(args, tiers, directory, conversation_pool_tokens(args))
            engine.generate([[1] * 32], SamplingParams(max_tokens=2))  # warm up
            results[name] = describe(name, converse(engine, args))
            engine.close()
        # No reuse: the two engines take turns, so the box's load falls on both alike.
        engines = [
            build(args, tiers, tempfile.mkdtemp(dir=directory), no_reuse_pool_tokens(args))
            for tiers in (None, args.tiers)
        ]
        rates: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(NO_REUSE_ROUNDS):
            for name, engine in zip(names, engines, strict=True):
                rates[name].append(no_reuse_tokens_per_s(engine, args, seed=1000 + round_))
        for engine in engines:
            engine.close()
    (base_p50, base_p99), (p50, p99) = results.values()
    print(f"{'ratio with/without':>22}  {p50 / base_p50:9.2f}x {p99 / base_p99:9.2f}x")
    base_rate, rate = (statistics.mean(values) for values in rates.values())
    print(
        f"no reuse ({args.no_reuse_prompts} prompts of {args.no_reuse_tokens} tokens in waves of "
        f"{NO_REUSE_WAVE}, {args.reply_tokens} out, {NO_REUSE_ROUNDS} rounds each): out tok/s "
        f"without {base_rate:.1f}, with {rate:.1f}, ratio {rate / base_rate:.3f}x"
    )


if __name__ == "__main__":
    main()
