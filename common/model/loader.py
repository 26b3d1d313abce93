"""Loads a Hugging Face folder's (sharded) safetensors into ``LlamaForCausalLM``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from common.config import LOAD_FORMATS, ModelConfig
from common.model.llama import LlamaForCausalLM, rope_inverse_frequencies

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


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        if not path.is_file():
            raise ValueError(f"weight file {path} is missing")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"corrupt weight file {path}: {exc}") from exc


# The spread of dummy weights: the initialisation of most Hugging Face Llama configs.
_DUMMY_STD = 0.02


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str = "auto"
) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the checkpoint,
    or, with ``load_format="dummy"`` (vLLM's name), with random weights drawn on the device:
    a model's real shape, and so its real speed, with nothing but its config.json (an 8B
    model's 16 GB are neither read nor copied).

    Raises ``ValueError`` naming the files or tensors at fault if a weight is missing, has the
    wrong shape, or a file cannot be read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    # .to(dtype) cast every buffer; the RoPE frequencies must stay float32 for exact positions.
    model.rotary.inv_freq = rope_inverse_frequencies(config).to(device)
    if load_format == "dummy":
        return _fill_randomly(model).eval()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in _read_tensors(_weight_files(config.path)):
        target, shard = _target_name(name)
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


@torch.no_grad()
def _fill_randomly(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Norm weights 1, biases 0, every other weight normal(0, 0.02): logits of a sane spread,
    so sampling and the attention see the numbers a trained model's would have in range."""
    generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
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


def _copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
