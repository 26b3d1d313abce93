"""The engine flags every model-running command shares (`generate`, `prefill`, `decode`)."""

from __future__ import annotations

import argparse

from common.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from common.engine.memory import parse_memory_size
from common.lora_adapters import parse_lora_module
from common.model.quantization import QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)"
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"]
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    # vLLM's flag name; pdserve calls the unit a page throughout.
    group.add_argument(
        "--block-size", dest="page_size", type=int, default=16, help="tokens per KV page"
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; fp8: e4m3 pages; int8: Hadamard-turned int8 pages, the "
        "closest to the model's answers at half the memory (docs/kv-formats.md)",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=None,
        help="memory for the KV pool, e.g. 4GiB (default: derived from the device); on a CPU "
        "all tensor-parallel ranks share it, on GPUs each rank has it",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument(
        "--kv-offloading-size",
        type=_gib,
        default=0,
        help="GiB of host memory for a KV tier below the pool: prefix-cache pages the pool "
        "evicts are kept there and restored on a hit (default: 0, none; docs/kv-tiers.md)",
    )
    group.add_argument(
        "--kv-offloading-dir",
        default=None,
        help="directory of a disk KV tier below the pool (and the host tier); workers on one "
        "host may share it (default: none)",
    )
    group.add_argument(
        "--kv-offloading-disk-size",
        type=_gib,
        default=16 << 30,
        help="GiB of disk the disk KV tier may fill (default: 16)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (default: 2048 on a GPU, 256 on a CPU)",
    )
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="prompt tokens per step while sequences are decoding: bounds their inter-token "
        "latency during a prefill (default: the whole step; pdserve up: 16 on CPU decode "
        "workers)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch the next decode step before this one's tokens are read, so the device "
        "does not wait for the host between steps (default: on with CUDA; on a CPU the host is "
        "the device, and each token would go out a step later)",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the plain torch model: no prepacked weights or fused CPU kernels, no CUDA graphs",
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="auto: the model folder's safetensors; dummy: random weights of its config's "
        "shape, made on the device (benchmarks of a real model's speed without its weights)",
    )
    group.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="the method the checkpoint's weights must be quantized with (default: read from "
        "the checkpoint: its quantization_config, or a GGUF file)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many processes (one GPU each on CUDA, gloo on the CPU); "
        "rank 0 schedules and samples, and alone speaks to the router",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts' experts spread whole over the tensor-parallel ranks, "
        "instead of each expert split over all of them",
    )
    group.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels: a request's tokens and logprobs do not depend on the "
        "batch, chunking, prefix cache or worker (C kernels on a CPU, Triton on CUDA)",
    )
    group.add_argument(
        "--simulated-engine",
        default=None,
        metavar="COST_MODEL.json",
        help="run no model: each step sleeps for the time this cost model gives and emits "
        "deterministic tokens, over the real scheduler, pages and wire (docs/planner.md)",
    )
    add_lora_args(parser)
    spec = parser.add_argument_group("speculative decoding (decode side)")
    spec.add_argument(
        "--speculative-method",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="propose tokens by n-gram lookup in the sequence itself, or with a draft model "
        "(default: off; draft when --speculative-model is given)",
    )
    spec.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="most tokens proposed per step"
    )
    spec.add_argument("--ngram-max", type=int, default=4, help="longest n-gram looked up")
    spec.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram looked up")
    spec.add_argument(
        "--speculative-model", default=None, help="draft model folder (same tokenizer)"
    )
    spec.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="do not speculate while more sequences than this are decoding",
    )


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags (docs/lora.md); the router takes ``--enable-lora`` and
    ``--lora-modules`` too, to list and route the adapters."""
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters over the base model"
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start, as name=path or vLLM's JSON form "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request names one as its model',
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="adapters computed in one step (device slots); requests for more wait",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory, least recently used out first (default: --max-loras)",
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest rank served")


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig:
    names = [module.name for module in args.lora_modules]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names {duplicates} more than once")
    return LoraConfig(
        enable_lora=args.enable_lora,
        modules={module.name: module.path for module in args.lora_modules},
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache=CacheConfig(
            page_size=args.page_size,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_dir=args.kv_offloading_dir,
            kv_offloading_disk_size=args.kv_offloading_disk_size,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
            async_scheduling=args.async_scheduling,
        ),
        speculative=speculative_config_from_args(args),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_deterministic_inference=args.enable_deterministic_inference,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        lora=lora_config_from_args(args),
        simulated_engine=args.simulated_engine,
    )
    config.validate()
    return config


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    method = args.speculative_method
    if method is None and args.speculative_model is not None:
        method = "draft"
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        model=args.speculative_model,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
    )


def _gib(text: str) -> int:
    """A size in GiB (vLLM's unit for --kv-offloading-size), fractions allowed, as bytes."""
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if gib < 0:
        raise argparse.ArgumentTypeError(f"a size in GiB must not be negative, got {text}")
    return int(gib * (1 << 30))
