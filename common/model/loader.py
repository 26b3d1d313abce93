"""Loads a checkpoint (``common/model/checkpoint_files.py``) into ``LlamaForCausalLM``.

Under tensor parallelism each rank reads only its slices of the checkpoint's dense tensors
(safetensors reads a slice without the rest): the rows of its heads, MLP width and vocabulary,
or the columns of the row-parallel layers' inputs (``common/model/parallel.py``). A quantized
layer is read whole and sliced with its scales, a group of inputs never split between ranks.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from common.config import LOAD_FORMATS, QK_NORM_PER_PROJECTION, ModelConfig
from common.model.checkpoint_files import TensorSlice, checkpoint_tensors
from common.model.llama import LlamaForCausalLM, rope_inverse_frequencies
from common.model.parallel import TensorParallel
from common.model.quantization import COMPRESSED_TENSORS, quantization_method
from common.model.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    QuantizedLinearTensors,
)
from common.model.quantization.drawn import quantized_drawn_layers
from common.model.quantized_layers import QuantizedEmbedding
from kernels.quantized import (
    STATIC,
    ActivationQuantization,
    QuantizedLinear,
    QuantizedWeight,
    cat_rows,
)

logger = logging.getLogger(__name__)

# Checkpoint names of tensors that pdserve stores fused: (checkpoint suffix, fused name, shard).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
}
# An MLP's projections (a dense layer's, an expert's, a shared expert's) by their checkpoint
# names, Mixtral's experts' w1/w3/w2 included: (pdserve's name, shard of gate_up or None).
_MLP_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
# Where an MLP's projections live: a dense layer's, the shared expert's, or expert N's (Mixtral's
# under block_sparse_moe).
_MLP_OWNER = re.compile(r"^(mlp|mlp\.shared_expert|(?:mlp|block_sparse_moe)\.experts\.(\d+))$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


# The spread of dummy weights: the initialisation of most Hugging Face Llama configs.
_DUMMY_STD = 0.02


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the checkpoint,
    or, with ``load_format="dummy"`` (vLLM's name), with random weights drawn on the device:
    a model's real shape, and so its real speed, with nothing but its config.json (an 8B
    model's 16 GB are neither read nor copied). A config with a compressed-tensors
    ``quantization_config`` gets its decoder layers' drawn weights quantized as its scheme says
    (``quantization/drawn.py``), so the step runs that format's kernels.

    A quantized checkpoint's layers keep their codes and scales (``QuantizedLinear``,
    ``QuantizedEmbedding``); the rest is in ``dtype``. ``quantization``: ``--quantization``,
    the method the checkpoint must hold (``common/model/quantization``).

    ``tp``: this rank's place in a tensor-parallel group; it reads (or draws) only its slices.

    Raises ``ValueError`` naming the files or tensors at fault if a weight is missing, has the
    wrong shape, or a file cannot be read.
    """
    tp = tp or TensorParallel()
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
    method = quantization_method(config, quantization)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    dummy = load_format == "dummy"
    # Weights a checkpoint may hold quantized get their storage as they arrive.
    _allocate(model, dtype, device, deferred=() if dummy else _DEFERRED)
    # _allocate gave every floating-point buffer ``dtype``; the RoPE frequencies must stay
    # float32 for exact positions.
    model.rotary.inv_freq = rope_inverse_frequencies(config).to(device)
    if dummy:
        _fill_randomly(model)
        if method == COMPRESSED_TENSORS:
            scheme = CompressedTensorsConfig.from_dict(config.quantization_config)
            for name, drawn in quantized_drawn_layers(model, scheme).items():
                _install_quantized(model, name, drawn, dtype, device)
        elif method is not None:
            logger.warning("--load-format dummy: random 16-bit weights, not %s ones", method)
        return model.eval()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    quantized_parts: dict[str, dict[int, QuantizedLinearTensors]] = {}
    held_experts = tp.experts(config.moe.num_experts) if config.moe is not None else range(0)
    for name, value in checkpoint_tensors(config, method, lambda n: _rank_slice(n, config, tp)):
        target, shard = _target_name(name, held_experts, config.qk_norm == QK_NORM_PER_PROJECTION)
        if target is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} does not fit {config.architecture}")
        if not isinstance(value, torch.Tensor):
            quantized = _as_linear_tensors(value)
            part = _rank_part(name, quantized.weight, config, tp)
            quantized = QuantizedLinearTensors(part, quantized.activations)
            quantized_parts.setdefault(target, {})[0 if shard is None else shard] = quantized
            continue
        if name in _VOCAB_ROWS:
            value = _pad_rows(value, len(tp.vocab_rows(config.vocab_size)))
        if shard is None:
            _copy_param(model, target, value, name, dtype, device)
            loaded.add(target)
        else:
            fused_parts.setdefault(target, {})[shard] = value
    for target, parts in fused_parts.items():
        if target in quantized_parts:
            raise ValueError(
                f"{target.removesuffix('.weight')}: its parts are quantized and 16-bit mixed; "
                "the layers pdserve fuses (q, k, v; gate, up) must be quantized alike"
            )
        if len(parts) != _expected_parts(target):
            continue  # reported below as missing
        merged = torch.cat([parts[i] for i in range(len(parts))])
        _copy_param(model, target, merged, target, dtype, device)
        loaded.add(target)
    for target, quantized_layers in quantized_parts.items():
        if len(quantized_layers) == _expected_parts(target):
            _install_quantized(model, target, quantized_layers, dtype, device)
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"weights missing from {config.path}: {shown}")
    return model.eval()


# Parameters a checkpoint may hold quantized: left on the meta device by _allocate until the
# loader knows which form they come in (a quantized layer's 16-bit storage is never made).
_DEFERRED = (".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight")
_DEFERRED_WHOLE = ("embed_tokens.weight", "lm_head.weight")


def _deferred(name: str, deferred: tuple[str, ...]) -> bool:
    return bool(deferred) and (name.endswith(deferred) or name in _DEFERRED_WHOLE)


def _allocate(
    model: nn.Module, dtype: torch.dtype, device: torch.device, deferred: tuple[str, ...] = ()
) -> None:
    """Storage on ``device`` for every parameter and buffer of a model built on the meta
    device, uninitialised, floating-point ones in ``dtype``; a tensor two modules share stays
    shared. Parameters whose names end with one of ``deferred`` (with the embedding and head,
    where any is) stay on the meta device. ``Module.to_empty`` then ``.to(dtype)`` would
    allocate a 16-bit model in float32 first (twice its bytes, on a GPU before the first weight
    is read), and to_empty's empty_like of a meta tensor runs torch's Python reference ops,
    whose first call imports sympy: seconds of every worker's start-up."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor): (it, its storage)

    def storage_for(meta: torch.Tensor) -> torch.Tensor:
        if id(meta) not in made:
            kind = dtype if meta.is_floating_point() else meta.dtype
            real = torch.empty(meta.shape, dtype=kind, device=device)
            if isinstance(meta, nn.Parameter):
                real = nn.Parameter(real, requires_grad=meta.requires_grad)
            made[id(meta)] = (meta, real)  # the meta tensor kept alive: its id stays its own
        return made[id(meta)][1]

    for prefix, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not _deferred(f"{prefix}.{name}".lstrip("."), deferred):
                setattr(module, name, storage_for(param))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, storage_for(buffer))


@torch.no_grad()
def _fill_randomly(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Norm weights 1, biases 0, every other weight normal(0, 0.02): logits of a sane spread,
    so sampling and the attention see the numbers a trained model's would have in range."""
    # Each rank draws its own slices: a sharded dummy model is as random as a whole one.
    generator = torch.Generator(device=model.device)
    generator.manual_seed(model.tp.rank)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, _DUMMY_STD, generator=generator)
    return model


def _target_name(
    name: str, experts: range, projection_norms: bool = False
) -> tuple[str | None, int | None]:
    """Map a checkpoint tensor name to (our parameter name, fused shard index or None); the name
    is None for tensors pdserve does not hold: derived buffers, and experts other than
    ``experts`` (this rank's). ``projection_norms``: q_norm and k_norm weigh whole projections
    (OLMoE's), which pdserve names apart from per-head ones."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    match = _LAYER_NAME.match(name)
    if match is None:
        return None, None  # rotary caches and other derived buffers some checkpoints carry
    layer, module, kind = match.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    if projection_norms and module in ("self_attn.q_norm", "self_attn.k_norm"):
        which = module.removeprefix("self_attn.").removesuffix("_norm")  # q or k
        return f"layers.{layer}.self_attn.{which}_projection_norm.{kind}", None
    if module == "block_sparse_moe.gate":  # Mixtral's router
        return f"layers.{layer}.mlp.gate.{kind}", None
    owner, _, projection = module.rpartition(".")
    owner_match = _MLP_OWNER.match(owner)
    if owner_match is None or projection not in _MLP_PROJECTIONS:
        return f"layers.{layer}.{module}.{kind}", None
    ours, part = _MLP_PROJECTIONS[projection]
    expert = owner_match.group(2)
    if expert is None:
        return f"layers.{layer}.{owner}.{ours}.{kind}", part
    if int(expert) not in experts:
        return None, None  # another rank's expert
    return f"layers.{layer}.mlp.experts.{int(expert) - experts.start}.{ours}.{kind}", part


# Checkpoint tensors split by rows of the vocabulary.
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def _rank_slice(name: str, config: ModelConfig, tp: TensorParallel) -> TensorSlice:
    """The part of checkpoint tensor ``name`` rank ``tp.rank`` holds (None: all of it)."""
    if tp.size == 1:
        return None
    if name in _VOCAB_ROWS:
        rows = tp.vocab_rows(config.vocab_size)
        return 0, min(rows.start, config.vocab_size), min(rows.stop, config.vocab_size)
    match = _LAYER_NAME.match(name)
    if match is None:
        return None
    return module_slice(match.group(2), config, tp)


def module_slice(module: str, config: ModelConfig, tp: TensorParallel) -> TensorSlice:
    """The part rank ``tp.rank`` holds of a decoder layer's ``module`` (its checkpoint name
    within the layer, e.g. ``self_attn.q_proj``): (0, rows) of a column-parallel layer's
    output, (1, columns) of a row-parallel layer's input, None for all of it."""
    if tp.size == 1:
        return None
    head_dim = config.head_dim
    heads = tp.heads(config.num_heads)
    kv_heads = tp.kv_heads(config.num_kv_heads)
    q_columns = (0, heads.start * head_dim, heads.stop * head_dim)
    kv_columns = (0, kv_heads.start * head_dim, kv_heads.stop * head_dim)
    split = {
        # Column-parallel: this rank's output rows (weights and biases alike).
        "self_attn.q_proj": q_columns,
        "self_attn.k_proj": kv_columns,
        "self_attn.v_proj": kv_columns,
        # Row-parallel: this rank's input columns.
        "self_attn.o_proj": (1, heads.start * head_dim, heads.stop * head_dim),
    }
    if config.qk_norm == QK_NORM_PER_PROJECTION:  # OLMoE's norms weigh each head's columns
        split |= {"self_attn.q_norm": q_columns, "self_attn.k_norm": kv_columns}
    if module in split:
        return split[module]
    return _mlp_slice(module, config, tp)


def _mlp_slice(module: str, config: ModelConfig, tp: TensorParallel) -> TensorSlice:
    """This rank's part of an MLP projection ``module`` (a dense layer's, an expert's or the
    shared expert's): gate/up's rows and down's columns of its slice of the width. Another
    rank's expert (expert parallelism) is read as nothing: an empty part."""
    owner, _, projection = module.rpartition(".")
    owner_match = _MLP_OWNER.match(owner)
    if owner_match is None or projection not in _MLP_PROJECTIONS:
        return None
    moe = config.moe
    expert = owner_match.group(2)
    if owner == "mlp":
        width = tp.part(config.intermediate_size)
    elif expert is None:
        assert moe is not None, "a shared expert belongs to a mixture"
        width = tp.part(moe.shared_expert_intermediate_size)
    else:
        assert moe is not None, "an expert belongs to a mixture"
        if int(expert) not in tp.experts(moe.num_experts):
            return 0, 0, 0
        width = tp.expert_part(moe.expert_intermediate_size)
    if _MLP_PROJECTIONS[projection][0] == "down_proj":
        return 1, width.start, width.stop
    return 0, width.start, width.stop


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows below it up to ``rows`` (the last rank's vocabulary padding)."""
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def _copy_param(
    model: nn.Module,
    target: str,
    tensor: torch.Tensor,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Fill parameter ``target`` of ``model`` from ``tensor`` (checkpoint name ``name``), giving
    it storage first where _allocate deferred it."""
    param = model.get_parameter(target)
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    if param.is_meta:
        kind = dtype if param.is_floating_point() else param.dtype
        owner, _, leaf = target.rpartition(".")
        param = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device), False)
        setattr(model.get_submodule(owner), leaf, param)
    with torch.no_grad():
        param.copy_(tensor)


def _expected_parts(target: str) -> int:
    """How many checkpoint tensors pdserve's parameter ``target`` is fused from."""
    return 3 if ".qkv_proj." in target else 2 if ".gate_up_proj." in target else 1


def _as_linear_tensors(value: object) -> QuantizedLinearTensors:
    if isinstance(value, QuantizedLinearTensors):
        return value
    if isinstance(value, QuantizedWeight):
        return QuantizedLinearTensors(value, None)
    raise TypeError(f"not a checkpoint tensor: {type(value).__name__}")


def _rank_part(
    name: str, weight: QuantizedWeight, config: ModelConfig, tp: TensorParallel
) -> QuantizedWeight:
    """This rank's part of quantized checkpoint tensor ``name``: rows or whole groups of
    columns, as ``_rank_slice`` says; the last rank's vocabulary padded with zero rows."""
    part = _rank_slice(name, config, tp)
    if part is not None:
        dim, start, stop = part
        try:
            weight = weight.rows(start, stop) if dim == 0 else weight.columns(start, stop)
        except ValueError as exc:
            raise ValueError(
                f"{name} cannot be split over {tp.size} ranks: {exc}; serve it with a "
                "tensor-parallel size whose slices hold whole groups"
            ) from exc
    if name in _VOCAB_ROWS:
        weight = _pad_quantized_rows(weight, len(tp.vocab_rows(config.vocab_size)))
    return weight


def _pad_quantized_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """``weight`` with rows of zero scales (and offsets) below it up to ``rows``: zero rows."""
    missing = rows - weight.out_features
    if missing == 0:
        return weight

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])

    offsets = None if weight.offsets is None else padded(weight.offsets)
    return QuantizedWeight(
        weight.kind,
        padded(weight.codes),
        padded(weight.scales),
        offsets,
        weight.group_size,
        weight.in_features,
    )


def _install_quantized(
    model: LlamaForCausalLM,
    target: str,
    parts: dict[int, QuantizedLinearTensors],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Put the quantized layer fused from ``parts`` where parameter ``target``'s module was:
    a ``QuantizedLinear`` (keeping the module's bias), or for the embedding a
    ``QuantizedEmbedding``, which a model with tied embeddings also multiplies its output by."""
    ordered = [parts[i] for i in range(len(parts))]
    weight = cat_rows([part.weight for part in ordered]).to(device)
    activations = _shared_activations([part.activations for part in ordered], target)
    module_name = target.removesuffix(".weight")
    if module_name == "embed_tokens":
        first_row = model.tp.vocab_rows(model.config.vocab_size).start
        model.embed_tokens = QuantizedEmbedding(weight, dtype, model.tp, first_row)
        if model.config.tie_word_embeddings:
            model.head = QuantizedLinear(weight, None, None, dtype)
        return
    if module_name == "lm_head":
        model.lm_head = None
        model.head = QuantizedLinear(weight, None, activations, dtype)
        return
    owner, _, leaf = module_name.rpartition(".")
    old = model.get_submodule(module_name)
    bias = old.bias if isinstance(old, nn.Linear) and old.bias is not None else None
    if bias is not None and bias.is_meta:
        raise ValueError(f"{module_name}: its bias is missing")
    setattr(model.get_submodule(owner), leaf, QuantizedLinear(weight, bias, activations, dtype))


def _shared_activations(
    parts: list[ActivationQuantization | None], target: str
) -> ActivationQuantization | None:
    """How the inputs of a layer fused from ``parts`` are rounded: as each part's, which must
    agree; static scales of parts that share one input take the largest (as vLLM does)."""
    first = parts[0]
    if any((p is None) != (first is None) for p in parts) or any(
        p is not None and first is not None and (p.kind, p.strategy) != (first.kind, first.strategy)
        for p in parts
    ):
        raise ValueError(
            f"{target.removesuffix('.weight')}: the layers fused into it round their inputs "
            "differently"
        )
    if first is None or first.strategy != STATIC:
        return first
    scale = max(p.static_scale for p in parts if p is not None and p.static_scale is not None)
    return ActivationQuantization(first.kind, STATIC, scale)
