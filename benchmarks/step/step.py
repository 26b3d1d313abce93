"""One engine step against its hardware floor, on one pinned core, in one run.

Decode: the time of a whole engine step (schedule, forward, sampling, bookkeeping) at batch 1,
8 and 32 over 256- and 1024-token contexts, beside the floor of a decode step: the time to read
every weight byte once (measured here as a streaming read of that many bytes, beside every
case, the fastest read of the run counting). Prefill: tokens/s of a step of 512 and 2048 prompt
tokens beside a bare GEMM of the model's shapes at the same rows, in bf16 (``F.linear``) and in
fp32 (``torch.mm``; the faster of the two on this machine is the floor). A row per case and a
column per engine, e.g. (SmolLM2 on a shared 2-core box)::

    batch  8 ctx  256       32.41 ms ( 1.61x)
     2048 tokens                 496 ( 76.7%)              228              646

    python -m benchmarks.step.step [--model PATH] [--dtype bfloat16] [--core 0] [--repeats 5]
        [--baseline]   # also the plain torch path (--enforce-eager, torch attention), same run
        [--kv-cache-dtypes auto,int8,fp8]   # a column per KV page format, same run
        [--bf16-tiles fma,dpbf16]   # a column per other bf16 tile kernel, same run
        [--weights W8A16,W4A16,FP8_DYNAMIC,GGUF_Q4_1,W4A16+head]   # a column per format

With ``--weights``, each format is the default model quantized here (``pdserve quantize``,
groups of 64; a ``+head`` suffix: ``--quantize-head``, the output projection quantized too;
``GGUF_Q4_1``: its own GGUF file, served as it is), and each decode step is shown beside its
own floor: the bytes of its own weights (codes, scales, offsets) read once. The summary puts
each format's step time over the first column's beside the ratio of their floors, the best a
format's bytes allow.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import add_core_argument, memory_read_seconds, pin_to_cores, random_prompts
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.quantization.writer import write_compressed_tensors
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library
from kernels.cpu.linear import onednn_reorders_bf16
from kernels.cpu.quantized_linear import CpuQuantizedLinear
from kernels.registry import ENV_VAR as ENV_BACKEND
from kernels.timing import best_seconds

GGUF_Q4_1 = "GGUF_Q4_1"
# A format name's suffix asking for the output projection quantized too.
WITH_HEAD = "+head"
# Groups of the grouped formats: 64 divides SmolLM2's 576 and 1536 columns.
GROUP_SIZE = 64


def bare_gemm_seconds(engine: LLMEngine, rows: int, dtype: torch.dtype, repeats: int) -> float:
    """The model's decoder-layer GEMMs (all layers) at ``rows`` rows, as plain torch calls."""
    shapes = engine.model.linear_shapes()
    layers = engine.model_config.num_layers
    weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for out, inp in shapes]
    if dtype == torch.float32:
        weights = [w.t().contiguous() for w in weights]
    inputs = [torch.randn(rows, inp, dtype=dtype) for _, inp in shapes]

    def run() -> None:
        for _ in range(layers):
            for x, w in zip(inputs, weights, strict=True):
                torch.mm(x, w) if dtype == torch.float32 else F.linear(x, w)

    return best_seconds(run, repeats)


def model_weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads of the model's weights: every decoder layer's linears and the
    head, each in the form it is kept (16-bit, or quantized codes with their scales)."""
    model = engine.model
    linears = [
        module
        for layer in model.decoder_layers()
        for module in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    config = engine.model_config
    head_bytes = config.vocab_size * config.hidden_size * engine.dtype.itemsize
    if isinstance(model.head, CpuQuantizedLinear):
        head_bytes = model.head.packed.tiles.nbytes
    return head_bytes + sum(_linear_bytes(module, engine.dtype) for module in linears)


def _linear_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    if isinstance(module, CpuQuantizedLinear):
        return module.packed.tiles.nbytes
    out_features, in_features = int(module.out_features), int(module.in_features)
    return out_features * in_features * dtype.itemsize


def quantized_models(formats: list[str], base: str | None, scratch: Path) -> dict[str, str]:
    """A model folder for each of ``formats`` (``writer.SCHEMES``, each maybe with
    ``WITH_HEAD``, or ``GGUF_Q4_1``)."""
    from common.model.default_model import default_gguf_model, resolve_model_path

    folders = {}
    for name in formats:
        if name == GGUF_Q4_1:
            folders[name] = str(default_gguf_model()[0])
        else:
            source = resolve_model_path(base)
            scheme = name.removesuffix(WITH_HEAD)
            folder = write_compressed_tensors(
                source, scratch / name, scheme, GROUP_SIZE, quantize_head=name != scheme
            )
            folders[name] = str(folder)
    return folders


def make_engine(
    args,
    max_batched: int,
    max_model_len: int,
    eager: bool = False,
    kv_cache_dtype: str = "auto",
    model: str | None = None,
) -> LLMEngine:
    """The engine as workers run it, or (``eager``) the plain torch path: torch modules and
    the torch reference attention."""
    previous = os.environ.get(ENV_BACKEND)
    if eager:
        os.environ[ENV_BACKEND] = "torch"
    try:
        return LLMEngine(
            EngineConfig(
                model=model or args.model,
                dtype=args.dtype,
                cache=CacheConfig(
                    kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=kv_cache_dtype
                ),
                scheduler=SchedulerConfig(
                    max_num_batched_tokens=max_batched, max_model_len=max_model_len
                ),
                enforce_eager=eager,
            )
        )
    finally:
        if eager:
            os.environ.pop(ENV_BACKEND)
            if previous is not None:
                os.environ[ENV_BACKEND] = previous


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Median time of one engine step while ``batch`` sequences decode at ``context`` tokens."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for prompt in random_prompts(batch, context, vocab, seed=context + batch):
        engine.add_request(prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished:
        engine.step()
    return statistics.median(times)


def prefill_tokens_per_second(engine: LLMEngine, num_tokens: int, repeats: int) -> float:
    """Prompt tokens/s of steps that each prefill ``num_tokens`` tokens (256-token prompts).
    Every step's prompts are new to the engine (their seed names the size and the repeat): a
    prompt seen before would come from the prefix cache and cost nothing."""
    length = min(256, num_tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = engine.model_config.vocab_size
    times = []
    for repeat in range(repeats + 1):
        seed = 1_000_000 * num_tokens + repeat
        for prompt in random_prompts(num_tokens // length, length, vocab, seed=seed):
            engine.add_request(prompt, params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished:
            engine.step()
        if repeat:  # the first step warms the allocator
            times.append(elapsed)
    return num_tokens / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_core_argument(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per case")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--baseline", action="store_true", help="also the plain torch path")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated, a column each")
    parser.add_argument(
        "--bf16-tiles",
        default="",
        help="comma-separated bf16 tile kernels (fma, dpbf16, amx) beside this machine's own, "
        "a column each",
    )
    parser.add_argument(
        "--weights",
        default="",
        help="comma-separated quantized formats of the model (W8A16, W4A16, FP8_DYNAMIC, ..., "
        "GGUF_Q4_1), a column each",
    )
    args = parser.parse_args()
    pin_to_cores({args.core})
    scratch = tempfile.TemporaryDirectory()
    torch.manual_seed(0)

    kv_dtypes = args.kv_cache_dtypes.split(",")
    engines = {
        "pdserve" if kv == "auto" else f"pdserve kv={kv}": make_engine(
            args, max_batched=2048, max_model_len=2048, kv_cache_dtype=kv
        )
        for kv in kv_dtypes
    }
    # An engine packed its tiles for the bf16 tile kernel that ran then, and runs only with it.
    kernels_of = dict.fromkeys(engines, contextlib.nullcontext)
    for tiles in filter(None, args.bf16_tiles.split(",")):
        name = f"pdserve tiles={tiles}"
        kernels_of[name] = lambda tiles=tiles: cpu_library.running_bf16_tiles(tiles)
        with kernels_of[name]():
            engines[name] = make_engine(args, max_batched=2048, max_model_len=2048)
    if args.baseline:
        engines["plain torch"] = make_engine(args, 2048, 2048, eager=True)
        kernels_of["plain torch"] = contextlib.nullcontext
    formats = [name for name in args.weights.split(",") if name]
    for name, folder in quantized_models(formats, args.model, Path(scratch.name)).items():
        engines[name] = make_engine(args, 2048, 2048, model=folder)
        kernels_of[name] = contextlib.nullcontext

    def timed(name: str, measure, *measure_args) -> float:
        with kernels_of[name]():
            return measure(engines[name], *measure_args)

    engine = next(iter(engines.values()))
    weight_bytes = model_weight_bytes(engine)
    print(f"model {engine.model_path.name}, {engine.dtype}, one core (#{args.core})")
    print(f"bf16 tiles: {cpu_library.bf16_tiles()} (this machine's own)")
    print(f"weights {weight_bytes / 1e6:.0f} MB")
    names = list(engines)
    # Each column's floor scales the first one's by the bytes its own weights take.
    bytes_of = {name: model_weight_bytes(engines[name]) for name in names}
    for name in formats:
        print(f"weights {name}: {bytes_of[name] / 1e6:.0f} MB")
    # The floor is read again beside every case and the fastest read of the run is the floor:
    # a shared machine's memory speed drifts over minutes, and one early reading can sit in a
    # slow (or fast) spell that the decode cases do not.
    floors = []
    steps: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for context in (256, 1024):
            for batch in (1, 8, 32):
                floors.append(memory_read_seconds(weight_bytes, args.repeats))
                steps[batch, context] = [
                    timed(name, decode_step_seconds, batch, context, args.steps) for name in names
                ]
    floor = min(floors)
    print(
        f"decode floor (read every weight byte once): {floor * 1e3:.2f} ms "
        f"(fastest of {len(floors)} reads through the run; slowest {max(floors) * 1e3:.2f} ms)"
    )
    print()
    print("decode step      " + "".join(f"{name:>24s}" for name in names))
    for (batch, context), times in steps.items():
        cells = [
            f"{seconds * 1e3:8.2f} ms ({seconds / (floor * bytes_of[name] / weight_bytes):5.2f}x)"
            for name, seconds in zip(names, times, strict=True)
        ]
        print(f"batch {batch:2d} ctx {context:4d}" + "".join(f"{c:>24s}" for c in cells))
    # Where oneDNN has no bf16 path (an AVX2 core), torch's bf16 GEMM is emulated, several times
    # slower than float32: no floor, and its 2048 rows would take minutes. Its column says so.
    bf16_gemm_is_native = onednn_reorders_bf16()
    prefill_rates: dict[str, list[float]] = {}
    with torch.inference_mode():
        print()
        print(
            "prefill step     "
            + "".join(f"{name + ' tok/s':>24s}" for name in names)
            + "   bare bf16 GEMM   bare fp32 GEMM"
        )
        for num_tokens in (512, 2048):
            rates = [
                timed(name, prefill_tokens_per_second, num_tokens, args.repeats) for name in names
            ]
            for name, rate in zip(names, rates, strict=True):
                prefill_rates.setdefault(name, []).append(rate)
            bf16 = (
                num_tokens / bare_gemm_seconds(engine, num_tokens, torch.bfloat16, 2)
                if bf16_gemm_is_native
                else None
            )
            fp32 = num_tokens / bare_gemm_seconds(engine, num_tokens, torch.float32, 2)
            best = max(bf16 or 0.0, fp32)
            cells = [f"{rate:8.0f} ({rate / best:6.1%})" for rate in rates]
            print(
                f"{num_tokens:5d} tokens     "
                + "".join(f"{c:>24s}" for c in cells)
                + (f"   {bf16:14.0f}" if bf16 else f"   {'emulated':>14s}")
                + f"   {fp32:14.0f}"
            )
    print("\n(x): decode step over its floor; (%): prefill over the faster bare GEMM")
    if formats:
        print()
        first = names[0]
        print(
            f"quantized formats against {first}: step time over {first}'s (its floor: the "
            "ratio of their weights' bytes)"
        )
        for (batch, context), times in steps.items():
            ratios = "  ".join(
                f"{name} {seconds / times[0]:.2f}x ({bytes_of[name] / bytes_of[first]:.2f}x)"
                for name, seconds in zip(names, times, strict=True)
                if name in formats
            )
            print(f"batch {batch:2d} ctx {context:4d}  {ratios}")
        for index, num_tokens in enumerate((512, 2048)):
            ratios = "  ".join(
                f"{name} {prefill_rates[first][index] / prefill_rates[name][index]:.2f}x"
                for name in names
                if name in formats
            )
            print(f"prefill {num_tokens:4d} tokens  {ratios}   (time per token over {first}'s)")
    scratch.cleanup()


if __name__ == "__main__":
    main()
