"""Does a greedy answer depend on the load around it? `pdserve up` with and without
--enable-deterministic-inference, the same chat prompts sent one at a time and then all at once
at a given concurrency.

For each configuration it prints how many answers came out identical (tokens and logprobs, bit
for bit), the share of tokens generated before the first divergence, and positional agreement,
one at a time against concurrent; and the same for two passes one at a time (the noise floor of
the comparison itself, which should be exact in both modes), e.g. (``--prompts 2 --tokens 8
--concurrency 2``)::

                    comparison                        bitwise      tokens    before 1st  positional
    deterministic   alone vs 2 concurrent              2/2         2/2           100.0%      100.0%

    python -m benchmarks.quality.deterministic [--model FOLDER] [--prompts 16] [--tokens 64]
        [--concurrency 8] [--pdserve-args "--kv-transfer nixl"]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness import chat_prompts, pdserve_up
from common.model.default_model import resolve_model_path
from common.tokenizer import Tokenizer

PORT = 8300
CONFIGURATIONS = {"default": [], "deterministic": ["--enable-deterministic-inference"]}
# One answer: the tokens' strings and their logprobs, as the API returned them.
Answer = tuple[tuple[str, ...], tuple[float, ...]]


async def ask(
    client: httpx.AsyncClient, base_url: str, model: str, prompt: list[int], tokens: int
) -> Answer:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True}  # fmt: skip
    response = await client.post(f"{base_url}/v1/completions", json=body)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]
    return tuple(logprobs["tokens"]), tuple(logprobs["token_logprobs"])


async def answers(
    base_url: str, model: str, prompts: list[list[int]], tokens: int, concurrency: int
) -> list[Answer]:
    """Every prompt's answer, at most ``concurrency`` requests in flight."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: list[int]) -> Answer:
            async with limit:
                return await ask(client, base_url, model, prompt, tokens)

        return await asyncio.gather(*(one(p) for p in prompts))


def agreement(reference: list[Answer], other: list[Answer]) -> str:
    """Answers identical bit for bit (tokens and logprobs), answers with identical tokens, the
    share of tokens before the first differing token, and tokens equal position by position."""
    pairs = list(zip(reference, other, strict=True))
    total = sum(len(tokens) for (tokens, _), _ in pairs)
    identical = sum(a == b for a, b in pairs)
    same_tokens = sum(a[0] == b[0] for a, b in pairs)
    before_first = sum(
        next((i for i, (x, y) in enumerate(zip(a[0], b[0], strict=True)) if x != y), len(a[0]))
        for a, b in pairs
    )
    positional = sum(x == y for a, b in pairs for x, y in zip(a[0], b[0], strict=True))
    return (
        f"{identical:>6}/{len(pairs):<4}{same_tokens:>7}/{len(pairs):<4}"
        f"{before_first / total:>14.1%}{positional / total:>12.1%}"
    )


def measure(args, model: Path, prompts: list[list[int]], flags: list[str], log: Path) -> list[str]:
    up_flags = ["--max-model-len", "2048", *shlex.split(args.pdserve_args), *flags]
    with pdserve_up(model, *up_flags, port=PORT, log=log, log_level="INFO") as cluster:
        run = lambda concurrency: asyncio.run(  # noqa: E731
            answers(cluster.base_url, model.name, prompts, args.tokens, concurrency)
        )
        first, second, concurrent = run(1), run(1), run(args.concurrency)
        return [agreement(first, second), agreement(first, concurrent)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pdserve-args", default="", help="extra flags for pdserve up")
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    prompts = chat_prompts(Tokenizer(model))[::2][: args.prompts]
    logs = Path(tempfile.mkdtemp(prefix="deterministic-"))
    print(
        f"{len(prompts)} chat prompts x {args.tokens} greedy tokens, {model.name}; logs in {logs}"
    )
    rows = {}
    for name, flags in CONFIGURATIONS.items():
        print(f"  {name} ...", flush=True)
        rows[name] = measure(args, model, prompts, flags, logs / f"pdserve-{name}.log")
    print(
        f"\n{'':16s}{'comparison':30s}{'bitwise':>11s}{'tokens':>12s}{'before 1st':>14s}"
        f"{'positional':>12s}"
    )
    for name, (floor, loaded) in rows.items():
        print(f"{name:16s}{'alone vs alone again':30s}{floor}")
        print(f"{'':16s}{f'alone vs {args.concurrency} concurrent':30s}{loaded}")


if __name__ == "__main__":
    main()
