"""A GGUF file's weights as pdserve keeps them, stored once beside its metadata folder.

Reading a GGUF costs seconds at every start (the gguf package parses its whole vocabulary, and
each block format is translated into ``QuantizedWeight``'s codes, scales and offsets). The
first engine to load a file writes what it read into ``gguf_blocks.safetensors`` in the file's
metadata folder (``common/model/gguf_checkpoint.py``, which is keyed by the file's identity):
the codes and scales exactly as translated, not dequantized, so every later start maps them in
milliseconds. Written to a private name and renamed into place: processes starting together
each write their own and one wins; a folder that cannot be written only costs the speed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kernels.quantized import QuantizedWeight

logger = logging.getLogger(__name__)

BLOCKS_FILE = "gguf_blocks.safetensors"
# Bump when what is stored changes, so copies written by an older pdserve are written again.
_FORMAT_VERSION = "1"
# How each quantized tensor's parts are named in the file.
_PARTS = ("codes", "scales", "offsets")


def read_or_translate_blocks(
    gguf_path: Path, folder: Path
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The file's tensors under their Hugging Face names (as ``read_gguf_weights`` gives them),
    from the folder's copy where it has a current one, else from the file (writing the copy)."""
    stored = folder / BLOCKS_FILE
    tensors = _read_copy(stored)
    if tensors is None:
        from common.model.gguf_weights import read_gguf_weights

        tensors = list(read_gguf_weights(gguf_path))
        _write_copy(stored, tensors)
    yield from tensors


def _write_copy(stored: Path, tensors: list[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
    flat: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for name, value in tensors:
        if isinstance(value, QuantizedWeight):
            layout[name] = {
                "kind": value.kind,
                "group_size": value.group_size,
                "in_features": value.in_features,
            }
            for part in _PARTS:
                tensor = getattr(value, part)
                if tensor is not None:
                    flat[f"{name}:{part}"] = tensor.contiguous()
        else:
            flat[name] = value.contiguous()
    metadata = {"format": "pt", "version": _FORMAT_VERSION, "quantized": json.dumps(layout)}
    try:
        handle, private = tempfile.mkstemp(prefix=stored.stem, dir=stored.parent)
        os.close(handle)
        try:
            save_file(flat, private, metadata=metadata)
            os.chmod(private, 0o644)  # as the folder's other files: readable by every user
            os.replace(private, stored)
        finally:
            if os.path.exists(private):
                os.unlink(private)
    except OSError as exc:
        logger.warning(
            "cannot keep the GGUF's blocks in %s (%s): every start reads the file",
            stored.parent,
            exc,
        )


def _read_copy(stored: Path) -> list[tuple[str, torch.Tensor | QuantizedWeight]] | None:
    """The copy's tensors, or None where there is none, or one of another version or damaged
    (then it is written again)."""
    if not stored.is_file():
        return None
    try:
        with safe_open(str(stored), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("version") != _FORMAT_VERSION:
                return None
            layout = json.loads(metadata["quantized"])
            names = list(handle.keys())
            parts = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        logger.warning(
            "the GGUF's stored blocks %s cannot be read (%s): reading the file", stored, exc
        )
        return None
    tensors: list[tuple[str, torch.Tensor | QuantizedWeight]] = []
    seen: set[str] = set()
    for key in names:
        name = key.split(":")[0]
        if name in seen:
            continue
        seen.add(name)
        if name not in layout:
            tensors.append((name, parts[key]))
            continue
        fields = layout[name]
        tensors.append(
            (
                name,
                QuantizedWeight(
                    fields["kind"],
                    parts[f"{name}:codes"],
                    parts[f"{name}:scales"],
                    parts.get(f"{name}:offsets"),
                    fields["group_size"],
                    fields["in_features"],
                ),
            )
        )
    return tensors
