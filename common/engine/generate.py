"""`pdserve generate`: run the one-process engine on one prompt and print the completion."""

from __future__ import annotations

import argparse
import logging
import sys

from common.engine.args import add_engine_args, engine_config_from_args
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve generate", description="Generate a completion in one process."
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn of the chat template"
    )
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(engine_config_from_args(args))
        tokenizer = Tokenizer(engine.model_path)
        if args.chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.sampling_seed,
        )
        [output] = engine.generate([prompt_ids], params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(tokenizer.decode(output))
    return 0
