"""Measure this box's step cost on a model and write it as the simulated engine's cost model.

    python -m benchmarks.step.cost_model --out benchmarks/cost_models/cpu-smollm2.json

Runs the real one-process engine (the default model unless ``--model``): prompts alone in
chunks of several sizes (prefill steps), then batches of decodes of several sizes at a few
contexts; times every step; fits ``fixed + per_token * tokens + per_seq * rows +
per_context_token * attended tokens`` by non-negative least squares; prints each measured step
class beside the fit's prediction; writes the JSON ``--simulated-engine`` reads
(``common/engine/simulated.py``).

By default on one thread, each step timed by the CPU time it took (``time.process_time``): on a
box other processes share, a step's wall time says how busy the box was, its CPU time what the
step costs one core. ``--threads N`` times wall time on N threads instead, for a quiet box.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from common.config import EngineConfig, SchedulerConfig
from common.cost_model import CostModel
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams


def box() -> str:
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*\\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return " ".join(flags) or "no AVX-512"


def measure(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, clock=time.process_time
) -> list[tuple]:
    """Run ``prompts`` to the end, one step at a time; each step as (tokens, rows, attended,
    decodes only, seconds by ``clock``)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished:
        started = clock()
        batch, _ = engine.run_step()
        seconds = clock() - started
        if not batch:
            continue
        tokens = sum(item.num_new_tokens for item in batch)
        attended = sum(item.seq.num_computed_tokens for item in batch)  # after the step
        decodes = all(item.num_new_tokens == 1 for item in batch)
        steps.append((tokens, len(batch), attended, decodes, seconds))
    return steps


def step_classes(steps: list[tuple]) -> dict[tuple[int, int, int], list[float]]:
    """The steps' times by (tokens, rows, attended tokens to the nearest 256 below)."""
    classes: dict[tuple[int, int, int], list[float]] = {}
    for tokens, rows, attended, _, seconds in steps:
        classes.setdefault((tokens, rows, attended // 256 * 256), []).append(seconds)
    return classes


def fit(steps: list[tuple]) -> list[float]:
    """Non-negative least squares of seconds on (1, tokens, rows, attended), over each step
    class's fastest step: on a shared box another process can only slow a step down, so the
    fastest of several is the closest to what the step costs the device alone."""
    classes = step_classes(steps)
    features = np.array([[1.0, t, r, a + 128.0] for t, r, a in classes])
    seconds = np.array([min(times) for times in classes.values()])
    free = [0, 1, 2, 3]
    while True:
        solution, *_ = np.linalg.lstsq(features[:, free], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients = [0.0] * 4
            for index, value in zip(free, solution, strict=True):
                coefficients[index] = float(value)
            return coefficients
        free.pop(int(np.argmin(solution)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=256, help="tokens per step")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, for a smoke run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1: one thread, steps timed by their CPU time; N: N threads, by wall time",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, max_model_len=2048),
        )
    )
    measure(engine, [[5] * 64], 2, clock)  # warm-up
    steps: list[tuple] = []
    chunk_sizes = [32, 128, args.budget] if args.quick else [16, 64, 128, args.budget]
    for size in chunk_sizes:
        for repeat in range(2 if args.quick else 3):
            prompt = [(i * 7 + size + repeat) % 1000 + 10 for i in range(size)]
            steps += measure(engine, [prompt], 1, clock)
    batches = [1, 8] if args.quick else [1, 4, 16, 32]
    for batch in batches:
        for context in (64, 512) if not args.quick else (64,):
            prompts = [[(i * 3 + j) % 900 + 20 for i in range(context)] for j in range(batch)]
            steps += [s for s in measure(engine, prompts, 8, clock) if s[3]]
    fixed, per_token, per_seq, per_context = fit(steps)
    model = CostModel(
        fixed_s=fixed,
        per_token_s=per_token,
        per_seq_s=per_seq,
        per_context_token_s=per_context,
        kv_tokens=engine.page_manager.num_pages * engine.config.cache.page_size,
        max_num_batched_tokens=args.budget,
        source=f"{engine.model_path.name} on {args.threads} thread(s) of this CPU ({box()}), "
        f"{'CPU' if args.threads == 1 else 'wall'} time, benchmarks/step/cost_model.py, "
        f"{time.strftime('%Y-%m-%d')}",
    )
    print(f"box: {box()}; {len(steps)} steps")
    print(
        f"fit: fixed {fixed * 1e3:.2f} ms + {per_token * 1e6:.1f} us/token + "
        f"{per_seq * 1e6:.1f} us/row + {per_context * 1e9:.1f} ns/attended token"
    )
    for (tokens, rows, attended), times in sorted(step_classes(steps).items()):
        predicted = model.step_seconds(tokens, rows, attended + 128)
        print(
            f"step tokens {tokens:4d} rows {rows:3d} attended ~{attended:6d}: fastest "
            f"{min(times) * 1e3:7.2f} ms, median {np.median(times) * 1e3:7.2f} ms, fit "
            f"{predicted * 1e3:7.2f} ms ({len(times)} steps)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(model.to_json(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
