"""Output tokens/s of the one-process engine against transformers `generate`, in one run.

Workload: 64 requests of 256 random prompt tokens, 64 output tokens each (ignore_eos), all
submitted at once to the engine; transformers runs them as static batches of 8 (left-padded,
greedy). Both in bf16 on the default model unless --model/--dtype say otherwise. It prints
each one's output tokens/s and their ratio, the last line::

    ratio engine / transformers: 1.99x

    python -m benchmarks.step.engine [--requests 64] [--prompt-len 256] [--output-len 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from benchmarks.harness import random_prompts
from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams


def run_engine(args, prompts) -> float:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048
            ),
        )
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm caches
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(tokens) == args.output_len for tokens in outputs)
    return sum(map(len, outputs)) / elapsed


def run_transformers(args, prompts, folder) -> float:
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        args.dtype
    ]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(prompts), args.hf_batch):
            ids = torch.tensor(prompts[begin : begin + args.hf_batch])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            generated += out[:, ids.shape[1] :].numel()
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    folder = resolve_model_path(args.model)
    vocab = AutoModelForCausalLM.from_pretrained(folder).config.vocab_size
    prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=0)
    print(f"model {folder.name}, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens")
    engine_tps = run_engine(args, prompts)
    print(f"pdserve engine:          {engine_tps:8.1f} output tok/s")
    hf_tps = run_transformers(args, prompts, folder)
    print(f"transformers (batch {args.hf_batch}):  {hf_tps:8.1f} output tok/s")
    print(f"ratio engine / transformers: {engine_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
