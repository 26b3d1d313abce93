"""Configuration: the model's shape (read from its folder) and the engine's knobs, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.context_window import DEFAULT_MAX_POSITIONS, layer_windows
from common.moe_config import MoEConfig, moe_config
from common.unimplemented_fields import refuse_unimplemented_fields
from kernels.cpu.features import has_amx_bf16

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}

# Where a family normalises queries and keys before RoPE: each head vector (Qwen3), or the
# whole projection, all heads at once (OLMoE).
QK_NORM_PER_HEAD = "head"
QK_NORM_PER_PROJECTION = "projection"
_QK_NORMS = {
    "qwen3": QK_NORM_PER_HEAD,
    "qwen3_moe": QK_NORM_PER_HEAD,
    "olmoe": QK_NORM_PER_PROJECTION,
}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family model, its experts included, as read from its
    ``config.json``."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLPs' width (a MoE model's experts: ``moe``)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    # Each layer's sliding window; None: all earlier positions (common/context_window.py).
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q/k/v projections
    # RMSNorm on q and k before RoPE: QK_NORM_PER_HEAD, QK_NORM_PER_PROJECTION or None.
    qk_norm: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_dtype: torch.dtype
    # The checkpoint's own ``quantization_config`` (common/model/quantization/), None if none.
    quantization_config: dict | None = None
    moe: MoEConfig | None = None  # the experts (common/moe_config.py); None: a dense model
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {config_file}: {exc}") from exc
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: Path) -> ModelConfig:
        architectures = raw.get("architectures") or []
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"unsupported architecture {architectures or raw.get('model_type')!r} in {path}; "
                f"pdserve supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[supported[0]]
        refuse_unimplemented_fields(raw, family)
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope_settings(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            path=path,
            architecture=supported[0],
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            layer_windows=layer_windows(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=_attention_bias(raw, family),
            qk_norm=_QK_NORMS.get(family),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            checkpoint_dtype=DTYPES.get(str(dtype_name), torch.float32),
            quantization_config=raw.get("quantization_config"),
            moe=moe_config(raw, family, raw["num_hidden_layers"]),
            clip_qkv=raw.get("clip_qkv") if family == "olmoe" else None,
        )


def _attention_bias(raw: dict, family: str) -> bool:
    """Whether q, k and v have biases: Qwen2's always, Qwen2-MoE's where ``qkv_bias`` (its
    default); other families' ``attention_bias`` also puts one on o, which they refuse."""
    if family == "qwen2":
        return True
    if family == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling; newer configs nest both under ``rope_parameters``."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope scaling {kind!r}; pdserve supports llama3")
        if kind == "default":
            scaling = None
    return float(theta), scaling


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` keeps the checkpoint's half-precision dtype, else bf16 (fp16 has no CPU kernels)."""
    if name == "auto":
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            return checkpoint_dtype if device.type == "cuda" else torch.bfloat16
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# auto: the model's dtype; fp8: e4m3 pages, a float32 scale per token and KV head; int8: pages
# turned by a Hadamard matrix, then int8 with a one-byte scale (kernels/kv_turn.py).
KV_CACHE_DTYPES = ("auto", "fp8", "int8")


# How weights are loaded: auto, the checkpoint's safetensors; dummy, random weights of the
# config's shape (vLLM's names).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(slots=True)
class CacheConfig:
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | int8 (see KV_CACHE_DTYPES)
    kv_cache_memory: int | None = None  # bytes for the pool; None: derive from the device
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_pages: int | None = None  # fixes the pool size outright (tests, benchmarks)
    # KV tiers below the pool (docs/kv-tiers.md): host memory, and disk in a directory.
    kv_offloading_size: int = 0  # bytes of host memory; 0: no host tier
    kv_offloading_dir: str | None = None  # None: no disk tier
    kv_offloading_disk_size: int = 16 << 30  # bytes of disk, with a directory

    @property
    def has_kv_tiers(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_offloading_dir)

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.kv_offloading_size < 0:
            raise ValueError("--kv-offloading-size must not be negative")
        if self.kv_offloading_disk_size <= 0:
            raise ValueError("--kv-offloading-disk-size must be positive")
        if self.has_kv_tiers and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-offloading-size and --kv-offloading-dir keep the prefix cache's pages: "
                "they need --enable-prefix-caching"
            )


def default_token_budget(device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """Tokens per step when not given. A GPU needs big steps to fill its cores. A CPU core's
    float32 FMAs reach their GEMM peak at a few hundred rows already, so bigger steps only delay
    every first token in them: with 256, a prefill worker hands each 256-token prompt to decode
    as soon as it is done instead of holding it for a batch of eight, and a decode worker's local
    prefill stalls its running batch for at most one such chunk. bf16 GEMMs on AMX tiles are
    another matter: 1.8x faster at 2048 rows than at 256, so a bf16 model on such a processor
    takes steps of 1024 (on a 2-core AMX Xeon W1 ran at 200 against 133 out tok/s, TTFT p50 193
    against 423 ms, and a 1800-token prompt's TTFT fell from 2.1 to 1.3 s)."""
    if device.type == "cuda":
        return 2048
    if dtype == torch.bfloat16 and has_amx_bf16():
        return 1024
    return 256


@dataclass(slots=True)
class SchedulerConfig:
    # Token budget of one forward (prefill chunks + decodes); None: default_token_budget().
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256  # sequences in the running batch
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Prompt tokens a step computes while sequences are decoding in it; None: the whole budget.
    # Every decoding sequence waits for the step, so a small cap bounds their inter-token
    # latency while a local prefill runs (pdserve up sets one on CPU decode workers).
    max_prefill_tokens_while_decoding: int | None = None
    # Launch the next decode step before this one's tokens are read, where it is known without
    # them (LLMEngine.run_step); None: on CUDA, where the host is free while the device works.
    async_scheduling: bool | None = None

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` once resolved: ``LLMEngine`` fills in the device's default
        before it builds anything that reads it."""
        assert self.max_num_batched_tokens is not None, "the default token budget is unresolved"
        return self.max_num_batched_tokens

    def validate(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap < 1:
            raise ValueError("--max-prefill-tokens-while-decoding must be >= 1")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding on the decode side (the prefill worker never speculates)."""

    method: str | None = None  # None (off) | ngram | draft
    num_speculative_tokens: int = 4  # the most tokens proposed per sequence per step
    ngram_max: int = 4  # the longest suffix n-gram looked up in the sequence's earlier tokens
    ngram_min: int = 1
    model: str | None = None  # the draft model's folder (method "draft"); same tokenizer
    # Speculation stops while more sequences than this are decoding: big batches already fill
    # the step, and every proposed token is one more row to verify. None: no limit.
    disable_by_batch_size: int | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def validate(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 15:
            raise ValueError("--num-speculative-tokens must be in [1, 15]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("--ngram-min and --ngram-max must satisfy 1 <= min <= max")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("--speculative-model is given exactly when the method is draft")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-disable-by-batch-size must be >= 1")


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters over the base model (vLLM's flags; common/engine/lora.py)."""

    enable_lora: bool = False
    # name -> folder of each adapter served from the start (--lora-modules).
    modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1  # adapters one step computes (device slots); requests for more wait
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras
    max_lora_rank: int = 16  # the largest rank served; the slots are this wide

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def validate(self) -> None:
        if self.modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.host_capacity < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.host_capacity}) must be at least --max-loras "
                f"({self.max_loras})"
            )


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face folder; None: the default model
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    seed: int = 0
    # Plain torch modules only: no prepacked weights, no fused C ops (vLLM's flag name).
    enforce_eager: bool = False
    # Batch-invariant kernels: a request's tokens and logprobs are the same bits whatever else
    # is in the batch, however its prompt is chunked or cached, whichever worker serves it.
    enable_deterministic_inference: bool = False
    # auto: the checkpoint's safetensors; dummy: random weights of the config's shape.
    load_format: str = "auto"
    # Ranks the model is split over (Megatron-style, common/model/parallel.py), one process
    # each; rank 0 is the engine, the others it spawns.
    tensor_parallel_size: int = 1
    # A mixture's experts spread whole over the tensor-parallel ranks instead of each split
    # (vLLM's --enable-expert-parallel; common/model/parallel.py).
    enable_expert_parallel: bool = False
    # The quantization method the checkpoint must hold (vLLM's --quantization); None: whatever
    # it holds (common/model/quantization).
    quantization: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A cost model's JSON: no model is loaded, each step sleeps for the time it gives
    # (common/engine/simulated.py). None: the real engine.
    simulated_engine: str | None = None

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        self.cache.validate()
        if self.cache.has_kv_tiers and self.tensor_parallel_size > 1:
            # Rank 0 schedules the restores, into its own pool: the other ranks' would miss them.
            raise ValueError("KV tiers (--kv-offloading-*) serve one rank: not with -tp > 1")
        if self.cache.has_kv_tiers and self.speculative.model is not None:
            # A draft model keeps its KV in the target's page ids: the tiers keep the target's.
            raise ValueError("KV tiers (--kv-offloading-*) do not keep a draft model's pages")
        self.scheduler.validate()
        self.speculative.validate()
        self.lora.validate()
        if self.simulated_engine is not None and (
            self.tensor_parallel_size > 1 or self.lora.enable_lora or self.speculative.enabled
        ):
            raise ValueError(
                "--simulated-engine runs no model: it cannot be combined with tensor "
                "parallelism, LoRA adapters or speculative decoding"
            )
        if self.enable_deterministic_inference and self.enforce_eager:
            raise ValueError(
                "--enable-deterministic-inference needs pdserve's own kernels; it cannot be "
                "combined with --enforce-eager"
            )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
