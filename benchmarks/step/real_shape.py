"""A real-size model's decode step and prefill beside the hardware's own limits, measured in one
run on one device, with random weights (``--load-format dummy``): nothing is downloaded. It is
also the one place that profiles a prefill step: on CUDA by kernel, on the CPU by part too.

The shape is Llama-3.1-8B's by default (its config.json ships in ``benchmarks/shapes/``; 16.1 GB
of bf16 weights, drawn on the device). Printed:

- ``copy``: the device's memory bandwidth, measured by a device-to-device copy (bytes read plus
  bytes written over the time), and ``matmul``: its bf16 dense throughput on a large GEMM,
  beside the datasheet peak where the device is known;
- ``decode batch B``: the engine's step (CUDA graphs) with ``B`` sequences of ``--context``
  tokens, beside the weight floor (weight bytes / bandwidth) and the floor with the step's KV
  reads added; the ratio to the weight floor is the figure to watch. A line (SmolLM2's shape on
  one CPU core)::

      decode batch 1: 19.85 ms/step, 5.77x the weight floor (5.23x with its KV reads), 50 tok/s

- ``prefill T``: one ``T``-token chunk of a new prompt, tokens/s and TFLOP/s (matmuls and
  causal attention) as a share of the datasheet and of the measured bf16 peak;
- ``profile batch B`` (with ``--profile``): the device's busy time in a decode step beside the
  step's wall time, and the kernels that take the most of it, per step; ``profile prefill T``
  (with ``--profile-prefill``) the same for a step that prefills ``T`` prompt tokens (one
  prompt, or prompts of ``--profile-prompt-tokens`` each). On the CPU the profiler lists the
  torch ops it sees, and ``parts prefill T`` follows: the fastest of three such steps with each
  part of the module path under a wall-clock timer (the GEMMs, attention, the KV store, the
  norms, RoPE, SiLU-and-multiply; the C kernels run through ctypes, where the profiler does not
  see them), each part's share of the step, and what is left (residual adds, Python per layer,
  embedding, head, sampling, bookkeeping)::

      parts prefill 512 (2 prompts of 256): 932.1 ms a step (549 tok/s), the fastest of 3
        GEMMs                       775.7 ms  83.2%

    python -m benchmarks.step.real_shape [--model DIR] [--batch-sizes 1,8,32,64] [--context 1024]
        [--profile 1,8] [--profile-prefill 512] [--quantization-scheme FP8_DYNAMIC]

``--quantization-scheme`` gives the shape's config a compressed-tensors ``quantization_config``
(one of ``pdserve quantize``'s presets), so the drawn decoder layers are quantized as that
checkpoint's would be and the step runs the format's kernels; the weight floor is then the
bytes of the codes and scales the model holds.

Without CUDA it runs on the CPU only with ``--allow-cpu``, on a shape the CPU can hold: a CPU
prefill step of the default model (``pdserve convert`` prints its folder) part by part, on one
pinned core, as 256-token prompts (one step of ``benchmarks.step.step``'s prefill)::

    python -m benchmarks.step.real_shape --allow-cpu --model FOLDER --core 0 --kv-cache-gib 1
        --batch-sizes 1 --prefill-chunks 512,2048 --profile-prefill 512,2048
        --profile-prompt-tokens 256
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks.harness import pin_to_cores, random_prompts
from benchmarks.step.moe_weights import weight_bytes as moe_weight_bytes
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.quantization.writer import SCHEMES, quantization_config
from common.sampling_params import SamplingParams
from kernels.quantized import QuantizedWeight

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
    # A profiled prefill step of several prompts takes them all in that one step.
    prompts_a_step = 1
    if args.profile_prompt_tokens:
        prompts_a_step = max(args.profile_prefill, default=0) // args.profile_prompt_tokens
    return LLMEngine(
        EngineConfig(
            model=str(args.model),
            dtype="bfloat16",
            device=str(device),
            load_format="dummy",
            cache=CacheConfig(kv_cache_memory=args.kv_cache_gib << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max(*args.batch_sizes, prompts_a_step),
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


def prefill_steps(engine: LLMEngine, tokens: int, prompt_tokens: int | None, seed: int):
    """A function that adds new prompts of ``tokens`` tokens in all (``prompt_tokens`` each,
    or one prompt) and runs the one step that prefills them, returning its seconds."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    length = prompt_tokens or tokens
    drawn = 0

    def step() -> float:
        nonlocal drawn
        drawn += 1
        for prompt in random_prompts(tokens // length, length, vocab, seed=seed + drawn):
            engine.add_request(prompt, params)
        synchronize(engine.device)
        began = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        seconds = time.perf_counter() - began
        while engine.has_unfinished:  # a prompt's one token ends it in that step
            engine.step()
        return seconds

    return step


def profile_prefill(
    engine: LLMEngine, tokens: int, prompt_tokens: int | None = None, steps: int = 3
) -> None:
    """Where the time of a step that prefills ``tokens`` new prompt tokens goes: by kernel
    (``profiled``; prefill runs eagerly, so a busy share well under 1 is the host's launches
    and waits), and on the CPU also by part (``prefill_parts``), which sees the C kernels that
    the profiler does not."""
    prefill = prefill_steps(engine, tokens, prompt_tokens, seed=tokens + 1)
    prefill()  # warm-up
    with profiled(engine, f"prefill {tokens}", steps):
        for _ in range(steps):
            prefill()
    if engine.device.type == "cpu":
        prefill_parts(engine, tokens, prompt_tokens, steps)


def prefill_parts(engine: LLMEngine, tokens: int, prompt_tokens: int | None, steps: int) -> None:
    """The fastest of ``steps`` prefill steps on the CPU, part by part: each part of the module
    path under a wall-clock timer (the GEMMs, attention, the KV store, the norms, RoPE,
    SiLU-and-multiply), its share of the step, and what is left (residual adds, Python per
    layer, embedding, head, sampling, bookkeeping)."""
    prefill = prefill_steps(engine, tokens, prompt_tokens, seed=7 * tokens)
    seconds: collections.Counter = collections.Counter()
    best: tuple[float, dict[str, float]] | None = None
    prefill()  # warm-up
    with timed_parts(seconds):
        for _ in range(steps):
            seconds.clear()
            step = prefill()
            if best is None or step < best[0]:
                best = (step, dict(seconds))
    assert best is not None
    step, parts = best
    prompts = f"{tokens // prompt_tokens} prompts of {prompt_tokens}" if prompt_tokens else "one"
    print(
        f"parts prefill {tokens} ({prompts}): {step * 1e3:.1f} ms a step "
        f"({tokens / step:.0f} tok/s), the fastest of {steps}",
        flush=True,
    )
    inside = parts.pop("model forward", 0.0)
    for part, part_seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {part:24s} {part_seconds * 1e3:8.1f} ms {part_seconds / step:6.1%}")
    rest = inside - sum(parts.values())
    print(f"  {'rest of the forward':24s} {rest * 1e3:8.1f} ms {rest / step:6.1%}")
    outside = step - inside
    print(f"  {'outside the forward':24s} {outside * 1e3:8.1f} ms {outside / step:6.1%}")


@contextlib.contextmanager
def timed_parts(seconds: collections.Counter) -> Iterator[None]:
    """While inside, every call of a CPU part (the methods below) adds its wall time to
    ``seconds[part]``. The C kernels run through ctypes, where torch.profiler does not see them;
    these timers do."""
    from common.model import llama
    from kernels.cpu import backend as cpu_backend
    from kernels.cpu import linear as cpu_linear
    from kernels.cpu import ops as cpu_ops

    # (owner, method, part): every call of the method counts toward the part.
    parts = [
        (cpu_linear.CpuLinear, "forward", "GEMMs"),
        (cpu_backend.CpuAttentionBackend, "attention", "attention"),
        (cpu_backend.CpuAttentionBackend, "store_kv", "KV store"),
        (cpu_ops.CpuRMSNorm, "forward", "RMSNorm"),
        (cpu_ops.CpuRMSNorm, "add_and_norm", "residual add + RMSNorm"),
        (cpu_ops.CpuRotaryApply, "forward", "RoPE"),
        (cpu_ops.CpuSiluAndMul, "forward", "SiLU-and-multiply"),
        (llama.LlamaForCausalLM, "forward", "model forward"),
    ]
    parts = [(owner, name, part) for owner, name, part in parts if hasattr(owner, name)]
    originals = [getattr(owner, name) for owner, name, _ in parts]

    def timer(method: Callable, part: str) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return run

    for (owner, name, part), method in zip(parts, originals, strict=True):
        setattr(owner, name, timer(method, part))
    try:
        yield
    finally:
        for (owner, name, _), method in zip(parts, originals, strict=True):
            setattr(owner, name, method)


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
    prefill = prefill_steps(engine, tokens, None, seed=tokens)
    prefill()  # warm-up
    return min(prefill() for _ in range(repeats))


def prefill_flops(engine: LLMEngine, tokens: int) -> float:
    """Matmul FLOPs of a ``tokens``-token prompt (2 per weight per token, the embedding table
    excluded: it is a lookup) plus causal attention's (QK^T and PV over half the square)."""
    config = engine.model_config
    if config.moe is not None:  # each token multiplies its top-k experts' weights only
        chosen = [float(config.moe.top_k)] * len(config.moe.sparse_layers)
        weights = moe_weight_bytes(config, 1, chosen)
    else:
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
        help="prompt tokens of prefill steps also profiled (by kernel; on the CPU, by part too), "
        "e.g. 512",
    )
    parser.add_argument(
        "--profile-prompt-tokens",
        type=int,
        default=None,
        help="tokens of each prompt in a profiled prefill step (default: the step is one prompt)",
    )
    parser.add_argument(
        "--quantization-scheme",
        choices=sorted(SCHEMES),
        default=None,
        help="the shape's decoder layers drawn, then quantized by this preset of pdserve "
        "quantize (the head stays 16-bit, as the preset leaves it)",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA")
    parser.add_argument("--core", type=int, default=None, help="on the CPU, the one core to use")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.profile = [int(b) for b in args.profile.split(",") if b]
    args.profile_prefill = [int(t) for t in args.profile_prefill.split(",") if t]
    args.prefill_chunks = [int(t) for t in args.prefill_chunks.split(",")]
    if args.profile_prompt_tokens and any(
        t % args.profile_prompt_tokens for t in args.profile_prefill
    ):
        parser.error("each --profile-prefill is a multiple of --profile-prompt-tokens")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
    elif args.allow_cpu:
        device, name = torch.device("cpu"), "CPU"
        if args.core is not None:
            pin_to_cores({args.core})
            name += f", one core (#{args.core})"
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

    scratch = contextlib.ExitStack()
    if args.quantization_scheme:
        folder = Path(scratch.enter_context(tempfile.TemporaryDirectory()))
        args.model = quantized_shape(args.model, args.quantization_scheme, folder)
    engine = build_engine(args, device)
    config = engine.model_config
    if config.moe is not None:
        # Every expert: a step of a few tokens reads fewer (benchmarks.step.moe counts them).
        every = [float(config.moe.num_experts)] * len(config.moe.sparse_layers)
        weight_bytes = moe_weight_bytes(config, engine.dtype.itemsize, every)
    else:
        weight_bytes = held_weight_bytes(engine.model)
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
        profile_prefill(engine, tokens, args.profile_prompt_tokens)
    scratch.close()
    return 0


def quantized_shape(model: Path, scheme: str, folder: Path) -> Path:
    """``model``'s config.json in ``folder`` with the ``quantization_config`` of ``pdserve
    quantize``'s preset ``scheme`` (groups of 128): the dummy load quantizes its drawn layers."""
    raw = json.loads((model / "config.json").read_text())
    raw["quantization_config"] = quantization_config(scheme)
    target = folder / f"{model.name}-{scheme}"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    return target


def held_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds, each in its form: 16-bit parameters, quantized
    codes with their scales and offsets (``qweight``), or the C kernels' packed tiles."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed", None)
        qweight = getattr(module, "qweight", None)
        if packed is not None:
            total += packed.tiles.nbytes
        elif isinstance(qweight, QuantizedWeight):
            total += qweight.nbytes()
    return total


if __name__ == "__main__":
    raise SystemExit(main())
