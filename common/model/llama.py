"""One implementation for the Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
and their mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (``common/model/moe.py``).

The model computes over a flattened batch of new tokens; where each token sits is given by
explicit ``AttentionMetadata``, and keys and values live in the paged ``KVPool``. Under tensor
parallelism each rank builds the model with its own slices of heads, MLP width and vocabulary
(``common/model/parallel.py``) and its KV pool holds only its KV heads. The numerics
follow Hugging Face ``transformers`` (RMSNorm in float32, RoPE tables in float32) so that greedy
tokens in float32 are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.config import QK_NORM_PER_HEAD, QK_NORM_PER_PROJECTION, ModelConfig
from common.engine.kv_pool import KVPool
from common.model.mlp import MLP, kept_if_none, swapped_linear, swapped_norm
from common.model.moe import SparseMoE
from common.model.parallel import TensorParallel
from common.model.quantized_layers import QuantizedEmbedding
from kernels.cpu.backend import SHORT_QUERY_MAX, CpuAttentionBackend, CpuAttentionPlan
from kernels.cpu.layer import FusedDecoderLayer, lora_rows
from kernels.cpu.linear import StepShape
from kernels.interface import AttentionBackend, AttentionMetadata, KVCacheView
from kernels.kv_turn import hadamard_turns
from kernels.layer_kernels import LayerKernels
from kernels.lora import LoraSegments
from kernels.quantized import QuantizedLinear

if TYPE_CHECKING:
    from common.model.lora_layers import LoraProjection


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """On the CPU, whatever the default device: a model is built on the meta device, where
    this arithmetic would run torch's Python decompositions (and import torch._dynamo)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # [head_dim / 2], a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [N, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, head_dim] (the two halves rotate together)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class RotaryApply(nn.Module):
    """Rotates queries and keys; a module so that a faster twin can stand in for it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        # This rank's heads: QKV is split by columns, O by rows (one all-reduce).
        self.num_heads = len(tp.heads(config.num_heads))
        self.num_kv_heads = len(tp.kv_heads(config.num_kv_heads))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        # q, k and v share one GEMM: one pass over the activations instead of three.
        # nn.Linear until use_kernels swaps in the device's twins.
        self.qkv_proj: nn.Module = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3's norm each head vector; OLMoE's whole projections, before the heads are split.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.q_projection_norm: ProjectionRMSNorm | None = None
        self.k_projection_norm: ProjectionRMSNorm | None = None
        if config.qk_norm == QK_NORM_PER_HEAD:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        elif config.qk_norm == QK_NORM_PER_PROJECTION:
            # Each KV head is held by as many ranks where there are fewer heads than ranks.
            kv_replicas = max(1, tp.size // config.num_kv_heads)
            self.q_projection_norm = ProjectionRMSNorm(
                self.q_size, config.num_heads * config.head_dim, 1, config, tp
            )
            self.k_projection_norm = ProjectionRMSNorm(
                self.kv_size, config.num_kv_heads * config.head_dim, kv_replicas, config, tp
            )
        self.clip_qkv = config.clip_qkv
        # use_kernels swaps in the device's twins of these modules.
        self.rotary: nn.Module = RotaryApply()
        self.softmax_scale = config.head_dim**-0.5
        # How many positions, its own included, a sliding-window layer reads; None: all.
        self.window = config.layer_windows[layer_index]
        # Set by LlamaForCausalLM.turn_kv_heads for pools of int8 pages (kernels/kv_turn.py).
        self.query_turn: nn.Module | None = None
        self.kv_turn: nn.Module | None = None
        # Adapter slots (common/model/lora.py's attach_lora); None: no LoRA served.
        self.qkv_lora: LoraProjection | None = None
        self.o_lora: LoraProjection | None = None

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: BoundKV,
        meta: AttentionMetadata,
        lora: LoraSegments | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if lora is not None and self.qkv_lora is not None:
            self.qkv_lora.add(qkv, hidden, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_projection_norm is not None and self.k_projection_norm is not None:
            q, k = self.q_projection_norm(q), self.k_projection_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        cache = kv.layers[self.layer_index]
        query_turn, kv_turn = self.query_turn, self.kv_turn  # both or neither (turn_kv_heads)
        if query_turn is not None and kv_turn is not None:
            q, k = self.rotary(q, k, *rope)
            q, k, v = (
                self._turn(query_turn, q),
                self._turn(kv_turn, k),
                self._turn(kv_turn, v),
            )
            kv.backend.store_kv(k, v, cache, meta.slot_mapping)
        else:
            # The backend may rotate and store in one pass (the Triton store on CUDA).
            q = kv.backend.rotate_and_store_kv(self.rotary, q, k, v, rope, cache, meta.slot_mapping)
        out = kv.backend.attention(q, cache, meta, self.softmax_scale, self.window)
        if query_turn is not None:
            out = self._turn(query_turn, out).to(hidden.dtype)
        out = out.reshape(-1, self.q_size)
        projected = self.o_proj(out)
        if lora is not None and self.o_lora is not None:
            # Before the all-reduce: this rank's columns of A give a partial sum, as o's own.
            self.o_lora.add(projected, out, lora)
        return self.tp.all_reduce(projected)

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Take ``kernels``' twins of the projections, the turns, the q/k norms and RoPE."""
        self.qkv_proj = swapped_linear(kernels, self.qkv_proj)
        self.o_proj = swapped_linear(kernels, self.o_proj)
        if self.query_turn is not None:
            self.query_turn = swapped_linear(kernels, self.query_turn)
        if self.kv_turn is not None:
            self.kv_turn = swapped_linear(kernels, self.kv_turn)
        if self.q_norm is not None:
            self.q_norm = swapped_norm(kernels.head_norm, self.q_norm)
        if self.k_norm is not None:
            self.k_norm = swapped_norm(kernels.head_norm, self.k_norm)
        self.rotary = kept_if_none(kernels.rotary(), self.rotary)

    def _turn(self, turn: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """Every head vector of ``heads [N, num_heads, head_dim]`` through ``turn``, in float32:
        turned queries, keys and values reach the kernels and the int8 store unrounded, so int8
        is the only rounding the turn adds (each bf16 rounding on the way costs answers)."""
        return turn(heads.reshape(-1, self.head_dim).float()).view(heads.shape)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection, all heads at once (OLMoE's q and k norms), of which
    this rank holds ``local_size`` columns (its heads; the loader gives it their weights). Under
    tensor parallelism the sum of squares is all-reduced, divided by ``replicas``, the ranks
    holding each column (KV heads fewer than ranks are held by several)."""

    def __init__(
        self, local_size: int, size: int, replicas: int, config: ModelConfig, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size))
        self.size, self.replicas, self.tp = size, replicas, tp
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        if self.tp.size == 1:
            mean_square = x32.pow(2).mean(-1, keepdim=True)  # RMSNorm's bits, unsharded
        else:
            squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
            mean_square = squares / (self.replicas * self.size)
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(dtype)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: each token is looked up on the rank holding
    its row, zeros elsewhere, and the all-reduce puts every row in place on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = tp.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        elsewhere = (local < 0) | (local >= len(self.rows))
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill(elsewhere[:, None], 0.0))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        # use_kernels swaps in the device's twins of the norms.
        self.input_layernorm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        # nn.Module for the type checker: the loader may swap either for its quantized twin.
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config.hidden_size, moe, tp)
            if moe is not None and moe.is_sparse(layer_index)
            else MLP(config.hidden_size, len(tp.part(config.intermediate_size)), tp)
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        pending: torch.Tensor | None,  # the previous layer's MLP output, not yet added
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: BoundKV,
        meta: AttentionMetadata,
        lora: LoraSegments | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the residual stream, this MLP's output
        """Each residual add is left to the norm after it (``add_and_norm``): the C norm adds
        and normalises in one pass. The last layer's MLP output is added by the caller."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = add_and_norm(self.input_layernorm, hidden, pending)
        attended = self.self_attn(normed, rope, kv, meta, lora)
        hidden, normed = add_and_norm(self.post_attention_layernorm, hidden, attended)
        if lora is None:
            return hidden, self.mlp(normed)
        assert isinstance(self.mlp, MLP), "adapters are attached to dense models only"
        return hidden, self.mlp(normed, lora)

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Take ``kernels``' twins of the norms, and of the attention's and MLP's parts."""
        self.input_layernorm = swapped_norm(kernels.norm, self.input_layernorm)
        self.post_attention_layernorm = swapped_norm(kernels.norm, self.post_attention_layernorm)
        self.self_attn.use_kernels(kernels)
        self.mlp.use_kernels(kernels)


def add_and_norm(
    norm: nn.Module, hidden: torch.Tensor, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden + delta`` and ``norm`` of it: one pass where the norm adds and normalises at
    once (the CPU's bf16 norm, the same bits), a torch add then the norm for every other."""
    # Looked up on the class: a missing attribute of a module instance goes through
    # nn.Module.__getattr__ and an exception, twice a layer every step.
    fused = getattr(type(norm), "add_and_norm", None)
    if fused is not None and hidden.dim() == 2 and hidden.shape == delta.shape:
        return fused(norm, hidden, delta)
    hidden = hidden + delta
    return hidden, norm(hidden)


class LayerThreads(Protocol):
    """Sets the threads each layer of a forward runs on (``common/service/core_loan.py``):
    asked before every layer, and once after the last."""

    def before_layer(self) -> None: ...

    def after_layers(self) -> None: ...


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        """``tp``: this rank's place in a tensor-parallel group; None, the whole model."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        # The table is built empty: the loader fills it, and nn.Embedding's own normal draw,
        # on the meta device, imports torch._dynamo (seconds of every worker's start-up).
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding | QuantizedEmbedding = (
            nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
            if tp.size == 1
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, len(tp.vocab_rows(config.vocab_size)), bias=False)
        )
        # Set by use_kernels where the kernels have a twin of it: the output projection as its
        # own module, tied weights included.
        self.head: nn.Module | None = None
        self.step_shape: StepShape | None = None  # the kernels' (LayerKernels.step_shape)
        self.kv: BoundKV | None = None
        # Each layer as one C call for steps of short runs, where every part of it would take
        # the C kernels anyway (kernels/cpu/layer.py); None where some part would not.
        self.fused_layers: list[FusedDecoderLayer] | None = None
        # Set by a worker whose forward may run on a paired worker's idle cores; None: the
        # process's thread count throughout.
        self.layer_threads: LayerThreads | None = None

    @property
    def device(self) -> torch.device:
        """Where the model runs: its RoPE frequencies' device (every other tensor may be held
        by kernel modules, as no parameter)."""
        return self.rotary.inv_freq.device

    def decoder_layers(self) -> list[DecoderLayer]:
        # nn.ModuleList is not generic: its items type as nn.Module.
        return cast("list[DecoderLayer]", list(self.layers))

    def bind_kv(self, pool: KVPool, backend: AttentionBackend) -> None:
        """Attach the KV pool every later forward reads and writes, and the backend that
        attends over it. Binding again (a warm-up pool, then the real one) replaces both."""
        self.kv = BoundKV(pool, backend, [pool.layer_view(i) for i in range(len(self.layers))])
        self.fuse_layers()

    def fuse_layers(self) -> None:
        """Build ``fused_layers`` for the bound pool, if every layer qualifies (after the
        layers took their kernels, and whenever another pool is bound)."""
        self.fused_layers = None
        # The C layer runs O and down to the residual add with no all-reduce between, and a
        # dense MLP.
        if (
            self.kv is None
            or not isinstance(self.kv.backend, CpuAttentionBackend)
            or self.tp.size > 1
            or any(isinstance(layer.mlp, SparseMoE) for layer in self.decoder_layers())
        ):
            return
        pairs = list(zip(self.decoder_layers(), self.kv.layers, strict=True))
        if all(FusedDecoderLayer.fusable(layer, cache) for layer, cache in pairs):
            self.fused_layers = [FusedDecoderLayer(layer, cache) for layer, cache in pairs]

    def turn_kv_heads(self) -> None:
        """Turn queries, keys and values by a Hadamard matrix around attention, for pools of
        int8 pages (``kernels/kv_turn.py``); before ``use_kernels``, which swaps in their twins."""
        device = self.device
        for layer in self.decoder_layers():
            attention = layer.self_attn
            attention.query_turn, attention.kv_turn = hadamard_turns(
                self.config.head_dim, torch.float32, device
            )

    def use_kernels(self, kernels: LayerKernels) -> None:
        """Every layer takes ``kernels``' twins of its parts, and so do the final norm and the
        output projection; a projection swapped in becomes ``head`` (tied weights included)
        and the separate ``lm_head``'s weight is dropped. A quantized head is one already."""
        for layer in self.decoder_layers():
            layer.use_kernels(kernels)
        self.norm = swapped_norm(kernels.norm, self.norm)
        self.step_shape = kernels.step_shape
        if isinstance(self.head, QuantizedLinear):
            self.head = swapped_linear(kernels, self.head)
            return
        if self.head is not None:
            return  # a twin already (the kernels were taken before)
        embedding = cast(nn.Embedding, self.embed_tokens)
        weight = embedding.weight if self.lm_head is None else self.lm_head.weight
        head = kernels.linear(weight, None)
        if head is not None:
            self.head = head
            self.lm_head = None

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(out, in)`` of one decoder layer's linear layers, for choosing GEMM kernels (of a
        mixture, one expert's and the router's)."""
        attention, mlp = self.decoder_layers()[0].self_attn, self.decoder_layers()[0].mlp
        hidden, q_size, kv_size = self.config.hidden_size, attention.q_size, attention.kv_size
        attention_shapes = [(q_size + 2 * kv_size, hidden), (hidden, q_size)]
        if isinstance(mlp, SparseMoE):
            return attention_shapes + mlp.linear_shapes()
        width = mlp.intermediate_size
        return [*attention_shapes, (2 * width, hidden), (hidden, width)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [M] rows of the batch whose next token is wanted
        lora: LoraSegments | None = None,  # the rows computing under adapters; None: none
    ) -> torch.Tensor:  # [M, vocab] float32
        if self.kv is None:
            raise RuntimeError("bind_kv must attach a KV pool before the first forward")
        # Per-step work of the backend, once for all layers.
        meta = self.kv.backend.plan(meta)
        if self.step_shape is not None:
            self.step_shape.short_runs_only = meta.max_query_len <= SHORT_QUERY_MAX
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions, hidden.dtype)
        threads = self.layer_threads
        try:
            if self._runs_fused(meta):
                assert self.fused_layers is not None and isinstance(meta, CpuAttentionPlan)
                hidden = hidden.contiguous()  # a fresh tensor: the layers update it in place
                scratch = torch.empty(
                    self.fused_layers[0].scratch_bytes(hidden.shape[0]), dtype=torch.uint8
                )
                adapter_rows = None if lora is None else lora_rows(lora)
                for fused in self.fused_layers:
                    if threads is not None:
                        threads.before_layer()
                    fused(hidden, rope, meta.slot_mapping, meta.step_args, scratch, adapter_rows)
                last = hidden[logits_indices]
            else:
                pending = None
                for layer in self.layers:
                    if threads is not None:
                        threads.before_layer()
                    hidden, pending = layer(hidden, pending, rope, self.kv, meta, lora)
                assert pending is not None  # a model has layers
                # The last residual add, on the rows the head reads only.
                last = hidden[logits_indices] + pending[logits_indices]
        finally:
            if threads is not None:
                threads.after_layers()
        hidden = self.norm(last)
        if self.head is not None:
            logits = self.head(hidden)
        else:
            # A quantized table always has its head set (the loader's QuantizedLinear).
            table = cast("nn.Embedding | VocabParallelEmbedding", self.embed_tokens)
            head = table.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, head)
        if self.tp.size > 1:
            # Each rank scored its rows of the vocabulary; the last one's padding goes.
            logits = self.tp.all_gather_columns(logits)[:, : self.config.vocab_size]
        return logits.float()

    def _runs_fused(self, meta: AttentionMetadata) -> bool:
        """Whether this step's layers run as single C calls: a step of short runs only, whose
        slots and rotary tables are laid out as the C kernels read them."""
        return (
            self.fused_layers is not None
            and isinstance(meta, CpuAttentionPlan)
            and meta.max_query_len <= SHORT_QUERY_MAX
            and not meta.long_chunks
            and meta.slot_mapping.dtype == torch.int64
            and meta.slot_mapping.is_contiguous()
        )


@dataclass(frozen=True, slots=True)
class BoundKV:
    """The KV pool a model is bound to, its backend, and each layer's view of the pool."""

    pool: KVPool
    backend: AttentionBackend
    layers: list[KVCacheView]
