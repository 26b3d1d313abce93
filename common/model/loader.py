"""Loads a Hugging Face folder's (sharded) safetensors into ``LlamaForCausalLM``.

Under tensor parallelism each rank reads only its slices of the checkpoint's tensors (safetensors
reads a slice without the rest): the rows of its heads, MLP width and vocabulary, or the
columns of the row-parallel layers' inputs (``common/model/parallel.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.config import LOAD_FORMATS, ModelConfig
from common.model.llama import LlamaForCausalLM, rope_inverse_frequencies
from common.model.parallel import TensorParallel

# Checkpoint names of tensors that pdserve stores fused: (checkpoint suffix, fused name, shard).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"corrupt weight index {index}: {exc}") from exc
        return sorted({folder / name for name in weight_map.values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


# A rank's part of one checkpoint tensor: (dimension, first index, end) or None for all of it.
_Slice = tuple[int, int, int] | None


def _read_tensors(
    files: list[Path], slice_of: Callable[[str], _Slice]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, or of each the part ``slice_of(name)`` says, read alone."""
    for path in files:
        if not path.is_file():
            raise ValueError(f"weight file {path} is missing")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = slice_of(name)
                    if part is None:
                        yield name, handle.get_tensor(name)
                        continue
                    dim, start, end = part
                    lazy = handle.get_slice(name)
                    index = (slice(None),) * dim + (slice(start, end),)
                    yield name, lazy[index]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"corrupt weight file {path}: {exc}") from exc


# The spread of dummy weights: the initialisation of most Hugging Face Llama configs.
_DUMMY_STD = 0.02


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the checkpoint,
    or, with ``load_format="dummy"`` (vLLM's name), with random weights drawn on the device:
    a model's real shape, and so its real speed, with nothing but its config.json (an 8B
    model's 16 GB are neither read nor copied).

    ``tp``: this rank's place in a tensor-parallel group; it reads (or draws) only its slices.

    Raises ``ValueError`` naming the files or tensors at fault if a weight is missing, has the
    wrong shape, or a file cannot be read.
    """
    tp = tp or TensorParallel()
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    _allocate(model, dtype, device)
    # _allocate gave every floating-point buffer ``dtype``; the RoPE frequencies must stay
    # float32 for exact positions.
    model.rotary.inv_freq = rope_inverse_frequencies(config).to(device)
    if load_format == "dummy":
        return _fill_randomly(model).eval()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in _read_tensors(
        _weight_files(config.path), lambda name: _rank_slice(name, config, tp)
    ):
        target, shard = _target_name(name)
        if name in _VOCAB_ROWS:
            tensor = _pad_rows(tensor, len(tp.vocab_rows(config.vocab_size)))
        if target is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} does not fit {config.architecture}")
        if shard is None:
            _copy_param(params[target], tensor, name)
            loaded.add(target)
        else:
            fused_parts.setdefault(target, {})[shard] = tensor
    for target, parts in fused_parts.items():
        expected = 3 if "qkv" in target else 2
        if len(parts) != expected:
            continue  # reported below as missing
        _copy_param(params[target], torch.cat([parts[i] for i in range(expected)]), target)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"weights missing from {config.path}: {shown}")
    return model.eval()


def _allocate(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Storage on ``device`` for every parameter and buffer of a model built on the meta
    device, uninitialised, floating-point ones in ``dtype``; a tensor two modules share stays
    shared. ``Module.to_empty`` then ``.to(dtype)`` would allocate a 16-bit model in float32
    first (twice its bytes, on a GPU before the first weight is read), and to_empty's
    empty_like of a meta tensor runs torch's Python reference ops, whose first call imports
    sympy: seconds of every worker's start-up."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor): (it, its storage)

    def storage_for(meta: torch.Tensor) -> torch.Tensor:
        if id(meta) not in made:
            kind = dtype if meta.is_floating_point() else meta.dtype
            real = torch.empty(meta.shape, dtype=kind, device=device)
            if isinstance(meta, nn.Parameter):
                real = nn.Parameter(real, requires_grad=meta.requires_grad)
            made[id(meta)] = (meta, real)  # the meta tensor kept alive: its id stays its own
        return made[id(meta)][1]

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, storage_for(param))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, storage_for(buffer))


@torch.no_grad()
def _fill_randomly(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Norm weights 1, biases 0, every other weight normal(0, 0.02): logits of a sane spread,
    so sampling and the attention see the numbers a trained model's would have in range."""
    # Each rank draws its own slices: a sharded dummy model is as random as a whole one.
    generator = torch.Generator(device=model.embed_tokens.weight.device)
    generator.manual_seed(model.tp.rank)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, _DUMMY_STD, generator=generator)
    return model


def _target_name(name: str) -> tuple[str | None, int | None]:
    """Map a checkpoint tensor name to (our parameter name, fused shard index or None)."""
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
    return f"layers.{layer}.{module}.{kind}", None


# Checkpoint tensors split by rows of the vocabulary.
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def _rank_slice(name: str, config: ModelConfig, tp: TensorParallel) -> _Slice:
    """The part of checkpoint tensor ``name`` rank ``tp.rank`` holds (None: all of it)."""
    if tp.size == 1:
        return None
    if name in _VOCAB_ROWS:
        rows = tp.vocab_rows(config.vocab_size)
        return 0, min(rows.start, config.vocab_size), min(rows.stop, config.vocab_size)
    match = _LAYER_NAME.match(name)
    if match is None:
        return None
    module, head_dim = match.group(2), config.head_dim
    heads = tp.heads(config.num_heads)
    kv_heads = tp.kv_heads(config.num_kv_heads)
    width = tp.part(config.intermediate_size)
    split = {
        # Column-parallel: this rank's output rows (weights and biases alike).
        "self_attn.q_proj": (0, heads.start * head_dim, heads.stop * head_dim),
        "self_attn.k_proj": (0, kv_heads.start * head_dim, kv_heads.stop * head_dim),
        "self_attn.v_proj": (0, kv_heads.start * head_dim, kv_heads.stop * head_dim),
        "mlp.gate_proj": (0, width.start, width.stop),
        "mlp.up_proj": (0, width.start, width.stop),
        # Row-parallel: this rank's input columns.
        "self_attn.o_proj": (1, heads.start * head_dim, heads.stop * head_dim),
        "mlp.down_proj": (1, width.start, width.stop),
    }
    return split.get(module)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows below it up to ``rows`` (the last rank's vocabulary padding)."""
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def _copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
