"""A checkpoint's tensors, one at a time, whatever it is stored in: Hugging Face safetensors
(sharded or not), a compressed-tensors checkpoint's quantized layers, or a GGUF file.

Each tensor comes under its Hugging Face name (GPTQ and AWQ layers too: their packed tensors
read by ``common/model/quantization/gptq_awq.py``). A dense one comes as a torch tensor, of which
``slice_of`` may ask only a part (a tensor-parallel rank's rows or columns, read without the
rest). A quantized linear layer comes whole, as ``QuantizedLinearTensors`` under its weight's
name, once all of its tensors are read: the loader slices it (``QuantizedWeight.rows`` and
``columns``), since its scales and codes are sliced together.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from common.config import ModelConfig
from common.model.gguf_checkpoint import gguf_weights_file
from common.model.quantization import AWQ, COMPRESSED_TENSORS, GGUF, GPTQ
from common.model.quantization.compressed_tensors import TENSOR_SUFFIXES as CT_SUFFIXES
from common.model.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    QuantizedLinearTensors,
)
from common.model.quantization.gptq_awq import TENSOR_SUFFIXES as PACKED_SUFFIXES
from common.model.quantization.gptq_awq import PackedIntConfig
from kernels.quantized import QuantizedWeight

# A rank's part of one checkpoint tensor: (dimension, first index, end) or None for all of it.
TensorSlice = tuple[int, int, int] | None
CheckpointValue = torch.Tensor | QuantizedLinearTensors


def checkpoint_tensors(
    config: ModelConfig, method: str | None, slice_of: Callable[[str], TensorSlice]
) -> Iterator[tuple[str, CheckpointValue]]:
    """Every weight of ``config``'s checkpoint, stored by quantization ``method`` (None: dense
    safetensors)."""
    if method == GGUF:
        yield from _gguf_tensors(config, slice_of)
        return
    files = _weight_files(config.path)
    if method is None:
        yield from _read_tensors(files, slice_of)
    elif method == COMPRESSED_TENSORS:
        ct = CompressedTensorsConfig.from_dict(config.quantization_config)
        quantized = lambda layer: ct.scheme_for(layer) is not None  # noqa: E731
        yield from _quantized_layers(ct, quantized, CT_SUFFIXES, files, slice_of)
    elif method in (GPTQ, AWQ):
        packed = PackedIntConfig.from_dict(config.quantization_config)
        yield from _quantized_layers(packed, packed.quantizes, PACKED_SUFFIXES, files, slice_of)
    else:
        raise ValueError(f"no reader for {method} checkpoints")


def _gguf_tensors(
    config: ModelConfig, slice_of: Callable[[str], TensorSlice]
) -> Iterator[tuple[str, CheckpointValue]]:
    """A GGUF file's tensors: quantized ones whole, the rank's part of dense ones. Read from
    the folder's copy of the file's blocks as pdserve keeps them (``gguf_blocks``), written by
    the first engine to load the file: reading a GGUF (its vocabulary, and every block
    translated) takes seconds, this copy milliseconds."""
    # Imported here: only GGUF models need the gguf package's reader.
    from common.model.gguf_blocks import read_or_translate_blocks

    path = gguf_weights_file(config.path)
    assert path is not None, f"{config.path} names no GGUF file"
    for name, value in read_or_translate_blocks(path, config.path):
        if isinstance(value, QuantizedWeight):
            yield name, QuantizedLinearTensors(value, None)
            continue
        part = slice_of(name)
        if part is not None:
            dim, start, stop = part
            value = value.narrow(dim, start, stop - start)
        yield name, value


class _LayerReader(Protocol):
    """A quantization config that knows which layers it stores packed, and reads one."""

    def layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> QuantizedLinearTensors: ...


def _quantized_layers(
    reader: _LayerReader,
    quantized: Callable[[str], bool],
    suffixes: tuple[str, ...],
    files: list[Path],
    slice_of: Callable[[str], TensorSlice],
) -> Iterator[tuple[str, CheckpointValue]]:
    """Dense tensors as they are read; each quantized layer (``quantized(layer)``, its tensors
    named ``layer.SUFFIX``) once all its tensors are."""
    layers: dict[str, dict[str, torch.Tensor]] = {}

    def layer_of(name: str) -> tuple[str, str] | None:
        layer, _, suffix = name.rpartition(".")
        if suffix in suffixes and quantized(layer):
            return layer, suffix
        return None

    def dense_slice(name: str) -> TensorSlice:
        return None if layer_of(name) is not None else slice_of(name)

    for name, tensor in _read_tensors(files, dense_slice):
        found = layer_of(name)
        if found is None:
            yield name, tensor
        else:
            layers.setdefault(found[0], {})[found[1]] = tensor
    for layer, tensors in layers.items():
        yield f"{layer}.weight", reader.layer(layer, tensors)


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


def _read_tensors(
    files: list[Path], slice_of: Callable[[str], TensorSlice]
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
