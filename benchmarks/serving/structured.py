"""What a structured output costs: W1 with every request under a JSON schema, against W1 without.

`pdserve up` (one prefill and one decode worker, the default model unless ``--model`` names
another) serves W1 (random prompts of ``--isl`` tokens, ``--osl`` output tokens, greedy,
ignore_eos, streamed) at each concurrency of ``--concurrencies``, once free and once with every
request's output held to a JSON schema, alternating the two ``--rounds`` times and keeping each
one's best. The schema is an array of at least ``--osl`` short strings (``schema_for``): each string
takes two tokens or more, so its grammar cannot end before ``--osl`` tokens, both runs generate
the same number of tokens (checked), and every step of the constrained run fills and applies a
mask for every row. One line per concurrency, the output
tok/s of each and their ratio (the goal: at least 0.9), e.g. on the 2-core AVX-512 Xeon::

    concurrency 8: free 352.6 out tok/s, json_schema 332.3 (0.94x)
    concurrency 32: free 423.7 out tok/s, json_schema 405.3 (0.96x)

    python -m benchmarks.serving.structured [--concurrencies 8,32] [--rounds 2] [--isl 256]
        [--osl 64] [--num-prompts 64] [--model FOLDER] [pdserve up flags]
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.harness import pdserve_up, random_prompts
from benchmarks.serving.load import report, run
from common.model.default_model import resolve_model_path
from common.tokenizer import Tokenizer


def schema_for(osl: int) -> dict:
    """An array of short strings that cannot close before ``osl`` tokens: an open array's grammar
    may end (and the request stop) whenever the model closes it, which would time fewer tokens."""
    return {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": osl}


def out_tok_s(args: argparse.Namespace, prompts: list[list[int]], model: str, extra) -> float:
    results, elapsed = asyncio.run(run(args, prompts, model, extra))
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    short = [r.output_tokens for r in results if r.output_tokens != args.osl]
    if short:
        raise RuntimeError(f"{len(short)} requests did not generate --osl tokens, e.g. {short[0]}")
    if args.verbose:
        report(results, elapsed, args)
    return sum(r.output_tokens for r in results) / elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None, help="model folder (default: pdserve up's)")
    p.add_argument("--concurrencies", default="8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--isl", type=int, default=256)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verbose", action="store_true", help="print each run's figures too")
    args, up_flags = p.parse_known_args(argv)
    folder = resolve_model_path(args.model)
    prompts = random_prompts(args.num_prompts, args.isl, len(Tokenizer(folder)), args.seed)
    with pdserve_up(folder, *up_flags) as cluster:
        args.base_url = cluster.base_url
        model = folder.name
        schema = schema_for(args.osl)
        constrained = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w1", "schema": schema},
            }
        }
        for concurrency in (int(c) for c in args.concurrencies.split(",")):
            args.concurrency = concurrency
            out_tok_s(args, prompts[:concurrency], model, constrained)  # warm: compile, connect
            best = {"free": 0.0, "json_schema": 0.0}
            for _ in range(args.rounds):
                for name, extra in (("free", None), ("json_schema", constrained)):
                    best[name] = max(best[name], out_tok_s(args, prompts, model, extra))
            print(
                f"concurrency {concurrency}: free {best['free']:.1f} out tok/s, json_schema "
                f"{best['json_schema']:.1f} ({best['json_schema'] / best['free']:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
