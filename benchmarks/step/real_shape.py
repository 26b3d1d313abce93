"""A real-size model's decode step and prefill beside the hardware's own limits, measured in one
run on one device, with random weights (``--load-format dummy``): nothing is downloaded.

The shape is Llama-3.1-8B's by default (its config.json ships in ``benchmarks/shapes/``; 16.1 GB
of bf16 weights, drawn on the device). Printed:

- ``copy``: the device's memory bandwidth, measured by a device-to-device copy (bytes read plus
  bytes written over the time), and ``matmul``: its bf16 dense throughput on a large GEMM,
  beside the datasheet peak where the device is known;
- ``decode batch B``: the engine's step (CUDA graphs) with ``B`` sequences of ``--context``
  tokens, beside the weight floor (weight bytes / bandwidth) and the floor with the step's KV
  reads added; the ratio to the weight floor is the figure to watch;
- ``prefill T``: one ``T``-token chunk of a new prompt, tokens/s and TFLOP/s (matmuls and
  causal attention) as a share of the datasheet and of the measured bf16 peak;
- ``profile batch B`` (with ``--profile``): the device's busy time in a decode step beside the
  step's wall time, and the kernels that take the most of it, per step; ``profile prefill T``
  (with ``--profile-prefill``) the same for a step that prefills a ``T``-token prompt.

    python -m benchmarks.step.real_shape [--model DIR] [--batch-sizes 1,8,32,64] [--context 1024]
        [--profile 1,8] [--profile-prefill 512]

Without CUDA it runs on the CPU only with ``--allow-cpu`` (for its plumbing, on a small shape).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.harness import random_prompts
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

SHAPES = Path(__file__).resolve().parent.parent / "shapes"
# Dense bf16 tensor-core peaks from the datasheets (TFLOP/s, without sparsity), by the start of
# torch.cuda.get_device_name(). Absent: only the measured GEMM is given.
DATASHEET_BF16_TFLOPS = {
    "NVIDIA H200": 989.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA A100": 312.0,
    "NVIDIA L40S": 362.0,
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second moved by a device-to-device copy, counting the read and the write."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dest = torch.empty_like(source)
    dest.copy_(source)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        dest.copy_(source)
    synchronize(device)
    return 2 * nbytes * repeats / (time.perf_counter() - began)


def matmul_tflops(device: torch.device, size: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    a @ b
    synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - began) / 1e12


def datasheet_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if name.startswith(k)), None)


def build_engine(args: argparse.Namespace, device: torch.device) -> LLMEngine:
    longest = args.context + args.steps + 16
    prompts = args.prefill_chunks + args.profile_prefill  # each prefilled in one step
    return LLMEngine(
        EngineConfig(
            model=str(args.model),
            dtype="bfloat16",
            device=str(device),
            load_format="dummy",
            cache=CacheConfig(kv_cache_memory=args.kv_cache_gib << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max(args.batch_sizes),
                max_model_len=max(longest, max(prompts) + 16),
                max_num_batched_tokens=max(prompts),
            ),
        )
    )


@contextlib.contextmanager
def decoding(engine: LLMEngine, batch: int, args: argparse.Namespace) -> Iterator[None]:
    """``batch`` sequences of ``--context`` tokens prefilled and a few decode steps warmed up;
    inside, each ``engine.step()`` is one decode step of the batch. Aborted on the way out."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(batch, args.context, vocab, seed=batch)
    ids = {engine.add_request(prompt, params) for prompt in prompts}
    started: set[str] = set()
    while started != ids:  # prefill: every sequence has its first token
        started |= {out.request_id for out in engine.step() if out.new_samples}
    for _ in range(3):  # warm-up
        engine.step()
    synchronize(engine.device)
    try:
        yield
    finally:
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished:
            engine.step()


def decode_step_seconds(engine: LLMEngine, batch: int, args: argparse.Namespace) -> float:
    """Seconds per decode step of ``batch`` sequences with ``--context`` tokens each."""
    with decoding(engine, batch, args):
        began = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        synchronize(engine.device)
        return (time.perf_counter() - began) / args.steps


def profile_decode(engine: LLMEngine, batch: int, args: argparse.Namespace, steps: int = 5) -> None:
    """Where a decode step's device time goes, by kernel (``profiled``). Whether CUPTI lists the
    kernels inside a CUDA graph's replay is the device's to say: a busy share near zero with
    graphs on means it did not."""
    with decoding(engine, batch, args), profiled(engine, f"batch {batch}", steps):
        for _ in range(steps):
            engine.step()


def profile_prefill(engine: LLMEngine, tokens: int, steps: int = 3) -> None:
    """Where the time of a step that prefills a new ``tokens``-token prompt goes (``profiled``):
    prefill runs eagerly, so a busy share well under 1 is the host's launches and waits."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = iter(random_prompts(steps + 1, tokens, vocab, seed=tokens + 1))

    def prefill() -> None:
        engine.add_request(next(prompts), params)
        while engine.has_unfinished:  # one step: the prompt's one token ends it
            engine.step()

    prefill()  # warm-up
    synchronize(engine.device)
    with profiled(engine, f"prefill {tokens}", steps):
        for _ in range(steps):
            prefill()


@contextlib.contextmanager
def profiled(engine: LLMEngine, label: str, steps: int, top: int = 12) -> Iterator[None]:
    """Runs the block (``steps`` steps) under torch.profiler, then prints the device's busy
    time per step beside the step's wall time (the rest is the device waiting for the host) and
    the kernels that take the most of it."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as profiler:
        began = time.perf_counter()
        yield
        synchronize(engine.device)
        wall_us = (time.perf_counter() - began) / steps * 1e6
    rows = []
    for event in profiler.key_averages():
        if on_cuda:  # kernels and copies on the device, not the host ops that launched them
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            self_us = event.self_device_time_total
        else:
            self_us = event.self_cpu_time_total
        if self_us > 0:
            rows.append((self_us / steps, event.count / steps, event.key))
    rows.sort(reverse=True)
    busy_us = sum(us for us, _, _ in rows)
    where = "device" if on_cuda else "host ops"
    print(
        f"profile {label}: {where} busy {busy_us:.0f} us of a {wall_us:.0f} us step "
        f"({busy_us / wall_us:.0%}; under the profiler), "
        f"{sum(calls for _, calls, _ in rows):.0f} {'kernels' if on_cuda else 'ops'} a step",
        flush=True,
    )
    for us, calls, name in rows[:top]:
        print(f"  {us:8.1f} us {us / busy_us:6.1%} {calls:5.0f}x  {name[:90]}")


def prefill_seconds(engine: LLMEngine, tokens: int, repeats: int = 3) -> float:
    """Seconds for one step that prefills a new ``tokens``-token prompt (the best of a few)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for prompt in random_prompts(repeats + 1, tokens, vocab, seed=tokens):  # one warms up
        engine.add_request(prompt, params)
        synchronize(engine.device)
        began = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        best = min(best, time.perf_counter() - began)
        while engine.has_unfinished:
            engine.step()
    return best


def prefill_flops(engine: LLMEngine, tokens: int) -> float:
    """Matmul FLOPs of a ``tokens``-token prompt (2 per weight per token, the embedding table
    excluded: it is a lookup) plus causal attention's (QK^T and PV over half the square)."""
    config = engine.model_config
    weights = sum(p.numel() for p in engine.model.parameters())
    weights -= engine.model.embed_tokens.weight.numel()
    attention = 2 * 2 * config.num_layers * config.num_heads * config.head_dim * tokens**2 / 2
    return 2 * weights * tokens + attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SHAPES / "Llama-3.1-8B")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per batch")
    parser.add_argument("--prefill-chunks", default="512,2048")
    parser.add_argument("--kv-cache-gib", type=int, default=24)
    parser.add_argument(
        "--profile",
        default="",
        help="batch sizes whose decode step is also profiled by kernel, e.g. 1,8",
    )
    parser.add_argument(
        "--profile-prefill",
        default="",
        help="prompt lengths whose prefill step is also profiled by kernel, e.g. 512",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.profile = [int(b) for b in args.profile.split(",") if b]
    args.profile_prefill = [int(t) for t in args.profile_prefill.split(",") if t]
    args.prefill_chunks = [int(t) for t in args.prefill_chunks.split(",")]
    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
    elif args.allow_cpu:
        device, name = torch.device("cpu"), "CPU"
    else:
        print("no CUDA device: nothing to measure (--allow-cpu runs the plumbing)")
        return 0

    bandwidth = copy_bandwidth(device, nbytes=1 << (30 if device.type == "cuda" else 26))
    measured_peak = matmul_tflops(device, size=8192 if device.type == "cuda" else 512)
    datasheet = datasheet_tflops(device)
    print(f"device: {name}")
    print(f"copy: {bandwidth / 1e9:.0f} GB/s (read + write)")
    print(
        f"matmul: {measured_peak:.1f} TFLOP/s bf16 measured"
        + (f", datasheet {datasheet:.0f}" if datasheet else "")
    )

    engine = build_engine(args, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    layout = engine.kv_layout
    kv_bytes_per_token = layout.bytes_per_page / layout.page_size  # every layer, K and V
    floor_s = weight_bytes / bandwidth
    print(
        f"model: {args.model.name}, {weight_bytes / 1e9:.1f} GB of weights; "
        f"weight floor {floor_s * 1e3:.2f} ms a step; CUDA graphs: "
        f"{'yes' if engine.runner.graphs is not None else 'no'}"
    )
    for batch in args.batch_sizes:
        step_s = decode_step_seconds(engine, batch, args)
        kv_floor_s = (weight_bytes + batch * args.context * kv_bytes_per_token) / bandwidth
        print(
            f"decode batch {batch}: {step_s * 1e3:.2f} ms/step, {step_s / floor_s:.2f}x the "
            f"weight floor ({step_s / kv_floor_s:.2f}x with its KV reads), "
            f"{batch / step_s:.0f} tok/s",
            flush=True,
        )
    for batch in args.profile:
        profile_decode(engine, batch, args)
    for tokens in args.prefill_chunks:
        seconds = prefill_seconds(engine, tokens)
        tflops = prefill_flops(engine, tokens) / seconds / 1e12
        shares = f"{tflops / measured_peak:.0%} of the measured GEMM"
        if datasheet:
            shares = f"{tflops / datasheet:.0%} of the datasheet peak, " + shares
        print(
            f"prefill {tokens}: {tokens / seconds:.0f} tok/s, {tflops:.1f} TFLOP/s ({shares})",
            flush=True,
        )
    for tokens in args.profile_prefill:
        profile_prefill(engine, tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
