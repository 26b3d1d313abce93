"""A decoder layer of a short-run step as one C call (``kernels/cpu/decoder_layer.c``).

In a decode step each layer is a dozen small calls from Python (norms, projections, RoPE, the
KV store, attention, SiLU, residual adds), and on one CPU core their dispatch costs about a
fifth of the step at batch 1. ``FusedDecoderLayer`` holds what the C layer needs that does not
change between steps (weight and page pointers, shapes) and runs the same kernels in the same
order, so a layer's output is the same bits as the module path's. It serves only where every
part would take the C kernels anyway: bf16 weights in tiles or quantized weights in theirs
(``kernels/cpu/quantized_linear.py``, W8A8 inputs rounded in C as the module path rounds them),
in any mix, bf16 rows, bf16, FP8 or int8 pages (int8 with
its Hadamard turns in float32 tiles, ``kernels/kv_turn.py``), C norms and RoPE, no query/key
norms, a step of short runs (through a sliding window or not); the module path keeps
everything else.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import library as cpu_library
from kernels.cpu.activation_rounding import ActivationRounding, activation_rounding
from kernels.cpu.backend import KV_DTYPE_CODES
from kernels.cpu.linear import CpuLinear
from kernels.cpu.lora_delta import LoraWeights, segment_args
from kernels.cpu.ops import CpuRMSNorm, CpuRotaryApply, CpuSiluAndMul
from kernels.cpu.quantized_linear import CpuQuantizedLinear
from kernels.interface import FP8_DTYPE, INT8_DTYPE, SCALE_DTYPES, KVCacheView
from kernels.lora import LoraSegments


class LinearWeights(ctypes.Structure):
    """``linear_weights`` of decoder_layer.c, field by field."""

    _fields_ = [
        ("tiles", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("quantized", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("has_offsets", ctypes.c_int32),
        ("rounding", ActivationRounding),
        ("lora", ctypes.c_void_p),  # a LoraWeights, or None
    ]


class LoraRows(ctypes.Structure):
    """``lora_rows`` of decoder_layer.c: the step's segments of rows under adapters."""

    _fields_ = [
        ("starts", ctypes.c_void_p),
        ("ends", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("count", ctypes.c_int32),
    ]


def linear_weights(
    linear: CpuLinear | CpuQuantizedLinear, lora: LoraWeights | None = None
) -> LinearWeights:
    """What the C layer reads of a projection that ``FusedDecoderLayer.fusable`` accepts, and of
    its adapter slots (``lora``, kept alive by the caller), if it has them."""
    lora_pointer = None if lora is None else ctypes.addressof(lora)
    if isinstance(linear, CpuQuantizedLinear):
        packed = linear.packed
        return LinearWeights(
            tiles=packed.tiles.data_ptr(),
            bias=None if linear.bias32 is None else linear.bias32.data_ptr(),
            quantized=1,
            kind=packed.code,
            group_size=packed.group_size,
            has_offsets=int(packed.has_offsets),
            rounding=activation_rounding(linear.activations),
            lora=lora_pointer,
        )
    assert linear.packed_tiles is not None
    return LinearWeights(
        tiles=linear.packed_tiles.data_ptr(),
        bias=None if linear.bias_tiles is None else linear.bias_tiles.data_ptr(),
        rounding=activation_rounding(None),
        lora=lora_pointer,
    )


class LayerWeights(ctypes.Structure):
    """``layer_weights`` of decoder_layer.c, field by field."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("qkv", LinearWeights),
        ("o", LinearWeights),
        ("gate_up", LinearWeights),
        ("down", LinearWeights),
        ("query_turn_tiles", ctypes.c_void_p),
        ("kv_turn_tiles", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("key_scale", ctypes.c_void_p),
        ("value_scale", ctypes.c_void_p),
        ("page_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("scale_page_stride", ctypes.c_int64),
        ("scale_token_stride", ctypes.c_int64),
        ("scale_head_stride", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("softmax_scale", ctypes.c_float),
        ("hidden", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("kv_dtype", ctypes.c_int32),
        ("window", ctypes.c_int32),
    ]


# The pages the layer takes.
_PAGE_DTYPES = (torch.bfloat16, FP8_DTYPE, INT8_DTYPE)
# The C store's row buffer (store_kv_quantized's MAX_DIM).
_MAX_QUANTIZED_HEAD_DIM = 1024


class FusedDecoderLayer:
    def __init__(self, layer, cache: KVCacheView) -> None:
        """``layer``: a ``DecoderLayer`` that ``fusable`` accepts; ``cache``: its KV pages."""
        attention, mlp = layer.self_attn, layer.mlp
        # Kept here so the pointers below outlive any swap of the layer's modules.
        self._keep = (layer.input_layernorm, layer.post_attention_layernorm, attention, mlp, cache)
        key_scale, value_scale = cache.key_scale, cache.value_scale
        scale_strides = (0, 0, 0) if key_scale is None else key_scale.stride()
        # The adapter slots' views, kept here with the layer's modules for the same reason.
        qkv_lora, o_lora, gate_up_lora, down_lora = self._lora = _adapter_slots(layer)
        self.weights = LayerWeights(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
            qkv=linear_weights(attention.qkv_proj, qkv_lora),
            o=linear_weights(attention.o_proj, o_lora),
            gate_up=linear_weights(mlp.gate_up_proj, gate_up_lora),
            down=linear_weights(mlp.down_proj, down_lora),
            query_turn_tiles=_tiles_pointer(attention.query_turn),
            kv_turn_tiles=_tiles_pointer(attention.kv_turn),
            key_cache=cache.key.data_ptr(),
            value_cache=cache.value.data_ptr(),
            key_scale=None if key_scale is None else key_scale.data_ptr(),
            value_scale=None if value_scale is None else value_scale.data_ptr(),
            page_stride=cache.key.stride(0),
            token_stride=cache.key.stride(1),
            head_stride=cache.key.stride(2),
            scale_page_stride=scale_strides[0],
            scale_token_stride=scale_strides[1],
            scale_head_stride=scale_strides[2],
            eps=layer.input_layernorm.eps,
            softmax_scale=attention.softmax_scale,
            hidden=layer.input_layernorm.weight.shape[0],
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            intermediate=mlp.intermediate_size,
            page_size=cache.page_size,
            kv_dtype=KV_DTYPE_CODES[cache.key.dtype],
            window=attention.window or 0,  # the C kernels' "none"
        )
        self._pointer = ctypes.addressof(self.weights)
        self._library = cpu_library.load()

    @staticmethod
    def fusable(layer, cache: KVCacheView) -> bool:
        """Whether every part of ``layer`` over ``cache`` runs the C kernels this call runs."""
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return (
            all(FusedDecoderLayer._projection_fits(linear) for linear in linears)
            and all(_bias_of(linear) is None for linear in linears[1:])
            and isinstance(layer.input_layernorm, CpuRMSNorm)
            and isinstance(layer.post_attention_layernorm, CpuRMSNorm)
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
            and isinstance(attention.rotary, CpuRotaryApply)
            and isinstance(mlp.act, CpuSiluAndMul)
            and attention.q_norm is None
            and attention.q_projection_norm is None
            and attention.clip_qkv is None
            and cache.key.dtype in _PAGE_DTYPES
            and cache.key.stride(-1) == 1
            and cache.key.stride() == cache.value.stride()
            and (not cache.is_quantized or FusedDecoderLayer._scales_fit(cache))
            # int8 pages hold turned heads, and only int8 pages do.
            and FusedDecoderLayer._turns_fit(attention) == cache.is_int8
            and FusedDecoderLayer._adapters_fit(layer, linears)
        )

    @staticmethod
    def _adapters_fit(layer, linears) -> bool:
        """Whether the layer has no adapter slots, or slots on every projection that the C
        kernel takes, over inputs the projections do not round (the adapters read the input
        unrounded, as the module path's do)."""
        slots = _adapter_slots(layer)
        if all(lora is None for lora in slots):
            return not _has_slots(layer)
        return all(lora is not None for lora in slots) and all(
            not isinstance(linear, CpuQuantizedLinear) or linear.activations is None
            for linear in linears
        )

    @staticmethod
    def _projection_fits(linear) -> bool:
        """Whether ``linear`` is bf16 in and out over tiles the C layer multiplies."""
        if isinstance(linear, CpuQuantizedLinear):
            return linear.dtype == torch.bfloat16
        return (
            isinstance(linear, CpuLinear)
            and linear.dtype == torch.bfloat16
            and linear.packed_tiles is not None
        )

    @staticmethod
    def _scales_fit(cache: KVCacheView) -> bool:
        key_scale, value_scale = cache.key_scale, cache.value_scale
        return (
            key_scale is not None
            and value_scale is not None
            and key_scale.dtype == value_scale.dtype == SCALE_DTYPES[cache.key.dtype]
            and key_scale.stride() == value_scale.stride()
            and cache.key.shape[-1] <= _MAX_QUANTIZED_HEAD_DIM
        )

    @staticmethod
    def _turns_fit(attention) -> bool:
        """Whether ``attention`` turns its heads, both turns in float32 tiles without bias (as
        ``LlamaForCausalLM.turn_kv_heads`` then ``layer_kernels.CpuKernels`` make them)."""
        turns = (attention.query_turn, attention.kv_turn)
        return all(
            isinstance(turn, CpuLinear)
            and turn.dtype == torch.float32
            and turn.packed_tiles is not None
            and turn.bias_tiles is None
            and turn.in_features == turn.out_features == attention.head_dim
            for turn in turns
        )

    def scratch_bytes(self, rows: int) -> int:
        return self._library.pdserve_decoder_layer_scratch_bytes(self._pointer, rows)

    def __call__(
        self,
        hidden: torch.Tensor,  # [rows, hidden] bf16, contiguous: updated in place
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [rows, head_dim] bf16
        slot_mapping: torch.Tensor,  # [rows] int64
        step_args: tuple,  # CpuAttentionPlan.step_args
        scratch: torch.Tensor,  # at least scratch_bytes(rows) bytes
        lora: LoraRows | None = None,  # lora_rows(segments), for layers with adapter slots
    ) -> None:
        cos, sin = rope
        status = self._library.pdserve_decoder_layer_bf16(
            self._pointer,
            hidden.data_ptr(),
            hidden.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            slot_mapping.data_ptr(),
            *step_args,
            None if lora is None else ctypes.addressof(lora),
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the C decoder layer could not allocate its scratch memory")


def lora_rows(segments: LoraSegments) -> LoraRows:
    """The C layer's view of a step's segments (whose tensors must outlive it)."""
    starts, ends, slots, count = segment_args(segments)
    return LoraRows(starts=starts, ends=ends, slots=slots, count=count)


def _adapter_slots(layer) -> tuple[LoraWeights | None, ...]:
    """The C kernel's view of the layer's adapter slots per projection (qkv, o, gate/up, down),
    None for a projection with none or with slots the kernel does not take."""
    return tuple(None if slots is None else slots.cpu_weights for slots in _slot_owners(layer))


def _has_slots(layer) -> bool:
    return any(slots is not None for slots in _slot_owners(layer))


def _slot_owners(layer) -> tuple:
    """Each projection's ``LoraProjection`` (common/model/lora_layers.py), or None."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        getattr(attention, "qkv_lora", None),
        getattr(attention, "o_lora", None),
        getattr(mlp, "gate_up_lora", None),
        getattr(mlp, "down_lora", None),
    )


def _bias_of(linear: CpuLinear | CpuQuantizedLinear) -> torch.Tensor | None:
    return linear.bias32 if isinstance(linear, CpuQuantizedLinear) else linear.bias_tiles


def _tiles_pointer(turn) -> int | None:
    """The address of a turn's float32 tiles, or None where the layer turns nothing."""
    return None if turn is None else turn.packed_tiles.data_ptr()
