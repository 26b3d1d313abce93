"""GGUF checkpoints read as they are: quantized tensors translated exactly into QuantizedWeight,
and a metadata folder in the cache that names the file for its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file
from tiny_gguf import (
    HIDDEN,
    INTERMEDIATE,
    NUM_HEADS,
    NUM_KV_HEADS,
    VOCAB_SIZE,
    write_tiny_llama_gguf,
)
from transformers import AutoTokenizer

from common.config import ModelConfig
from common.model import default_model
from common.model.default_model import default_gguf_model, find_default_gguf, resolve_model_path
from common.model.gguf_checkpoint import WEIGHTS_MARKER, gguf_weights_file
from common.model.gguf_llama import hf_tensor_name
from common.model.gguf_weights import read_gguf_weights
from kernels.quantized import INT8, UINT4, QuantizedWeight

T = GGMLQuantizationType
# What each type becomes: code kind, group size, and whether it has offsets.
QUANTIZED_TYPES = {
    T.Q8_0: (INT8, 32, False),
    T.Q4_0: (UINT4, 32, True),
    T.Q4_1: (UINT4, 32, True),
    T.Q4_K: (UINT4, 32, True),
    T.Q6_K: (INT8, 16, False),
    T.Q5_0: (INT8, 32, False),
    T.Q5_1: (INT8, 32, True),
    T.Q5_K: (INT8, 32, True),
}
DENSE_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def as_float32(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(torch.float32)
    return weight.float()


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (interleave each head's halves): written out
    here rather than inverted from the reader's code, so the test checks it."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def assert_same_float32(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal bit for bit, but for the sign of zero: llama.cpp's Q4_0 is d (q - 8), -0 where d is
    negative and q is 8, while d q - 8 d is +0."""
    assert got.dtype == expected.dtype == torch.float32, name
    assert got.shape == expected.shape, name
    same_bits = got.view(torch.int32) == expected.view(torch.int32)
    both_zero = (got == 0) & (expected == 0)
    assert bool((same_bits | both_zero).all()), f"{name}: differs from gguf's dequantization"


def assert_reads_as_gguf_dequantizes(path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor of `path` as read equals gguf's own dequantization of its bytes, with q/k
    rows in Hugging Face order; returns what was read."""
    weights = dict(read_gguf_weights(path))
    reader = GGUFReader(path)
    assert len(weights) == len(reader.tensors)
    kv_heads = reader.get_field("llama.attention.head_count_kv").contents()
    heads = reader.get_field("llama.attention.head_count").contents()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        # A copy: F32 tensors dequantize to a view of the read-only mapping.
        expected = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
        got = as_float32(weights[name])
        if name.endswith("q_proj.weight"):
            got = llama_cpp_permute(got, heads)
        elif name.endswith("k_proj.weight"):
            got = llama_cpp_permute(got, kv_heads)
        assert_same_float32(got, expected, f"{tensor.name} ({tensor.tensor_type.name})")
    return weights


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(folder))
    return folder


@pytest.mark.parametrize("kind", list(QUANTIZED_TYPES), ids=lambda kind: kind.name)
def test_quantized_types_translate_exactly(tmp_path: Path, kind: GGMLQuantizationType) -> None:
    path = write_tiny_llama_gguf(tmp_path / f"{kind.name}.gguf", kind)
    weights = assert_reads_as_gguf_dequantizes(path)
    code_kind, group, has_offsets = QUANTIZED_TYPES[kind]
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight)
    assert (q.kind, q.group_size, q.offsets is not None) == (code_kind, group, has_offsets)
    assert q.shape == (NUM_HEADS * HIDDEN // NUM_HEADS, HIDDEN)
    down = weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(down, QuantizedWeight) and down.shape == (HIDDEN, INTERMEDIATE)
    # The norms stay dense float32.
    assert weights["model.norm.weight"].dtype == torch.float32


def test_dense_types_keep_their_dtype(tmp_path: Path) -> None:
    types = {
        "blk.0.attn_q.weight": T.F16,
        "blk.0.attn_k.weight": T.BF16,
        "blk.1.ffn_up.weight": T.F32,
        "output.weight": T.F16,
    }
    path = write_tiny_llama_gguf(tmp_path / "dense.gguf", T.Q8_0, types)
    weights = assert_reads_as_gguf_dequantizes(path)
    for gguf_name, kind in types.items():
        weight = weights[hf_tensor_name(gguf_name)]
        assert isinstance(weight, torch.Tensor) and weight.dtype == DENSE_TYPES[kind], gguf_name


def test_types_mix_in_one_file(tmp_path: Path) -> None:
    # As llama.cpp's Q4_K_M does: Q6_K for some tensors, Q4_K for most, Q8_0 embeddings.
    types = {"token_embd.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q6_K}
    types |= {"blk.1.attn_v.weight": T.Q6_K, "blk.1.attn_k.weight": T.Q4_0}
    path = write_tiny_llama_gguf(tmp_path / "mixed.gguf", T.Q4_K, types, tied=True)
    weights = assert_reads_as_gguf_dequantizes(path)
    assert "lm_head.weight" not in weights  # tied to the embedding
    embedding = weights["model.embed_tokens.weight"]
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(embedding, QuantizedWeight) and embedding.kind == INT8
    assert isinstance(down, QuantizedWeight) and down.group_size == 16


def test_equals_the_dequantizing_conversion(tmp_path: Path) -> None:
    """Names and q/k row order agree with the bf16 folder the default model is converted to."""
    types = {"blk.0.attn_q.weight": T.Q6_K, "blk.1.attn_k.weight": T.Q4_0}
    path = write_tiny_llama_gguf(tmp_path / "model.gguf", T.Q4_1, types)
    converted = tmp_path / "converted"
    converted.mkdir()
    default_model._convert_gguf(path, converted, progress=False)
    expected = load_file(converted / "model.safetensors")
    weights = dict(read_gguf_weights(path))
    assert set(weights) == set(expected)
    for name, weight in weights.items():
        assert torch.equal(as_float32(weight).to(torch.bfloat16), expected[name]), name


def test_unsupported_type_is_refused_by_name(tmp_path: Path, cache: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "q2k.gguf", T.Q4_K, {"blk.1.ffn_gate.weight": T.Q2_K})
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate\.weight' is of type Q2_K"):
        next(read_gguf_weights(path))
    # Refused when the model is resolved, before any worker loads it.
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate\.weight' is of type Q2_K"):
        resolve_model_path(path)
    assert not list((cache / "gguf").glob("q2k-*"))


def test_a_quantized_norm_is_refused(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "norm.gguf", T.Q4_K, {"output_norm.weight": T.Q8_0})
    with pytest.raises(ValueError, match=r"'output_norm\.weight' is a 1-D Q8_0 tensor"):
        next(read_gguf_weights(path))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_llama_gguf(tmp_path / "tiny.gguf", T.Q4_K, {"output.weight": T.Q6_K})


def test_resolving_a_gguf_file_gives_a_metadata_folder(tiny_gguf: Path, cache: Path) -> None:
    folder = resolve_model_path(tiny_gguf)
    assert folder.parent == cache / "gguf" and folder.name.startswith("tiny-")
    assert not list(folder.glob("*.safetensors"))  # the weights stay in the GGUF
    assert gguf_weights_file(folder) == tiny_gguf.resolve()
    marker = json.loads((folder / WEIGHTS_MARKER).read_text())
    assert marker["path"] == str(tiny_gguf.resolve())
    assert marker["size"] == tiny_gguf.stat().st_size

    config = ModelConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_layers) == (HIDDEN, 2)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (
        NUM_HEADS,
        NUM_KV_HEADS,
        VOCAB_SIZE,
    )
    assert config.tie_word_embeddings is False
    assert config.eos_token_ids == (2,)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.encode("<|im_start|>user\nHello world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello world<|im_end|>"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the capital")) == [
        "Ġthe",
        "Ġcapital",
    ]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    # Resolved again, the finished folder is reused as it is.
    marker_mtime = (folder / WEIGHTS_MARKER).stat().st_mtime_ns
    assert resolve_model_path(str(tiny_gguf)) == folder
    assert (folder / WEIGHTS_MARKER).stat().st_mtime_ns == marker_mtime


def test_a_changed_or_missing_file_is_an_error(tiny_gguf: Path, cache: Path) -> None:
    folder = resolve_model_path(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ValueError, match="has changed since"):
        gguf_weights_file(folder)
    # The changed file is a new checkpoint: it gets a folder of its own.
    changed_folder = resolve_model_path(tiny_gguf)
    assert changed_folder != folder
    assert gguf_weights_file(changed_folder) == tiny_gguf.resolve()

    tiny_gguf.unlink()
    with pytest.raises(ValueError, match="no longer exists"):
        gguf_weights_file(changed_folder)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(tiny_gguf)


def test_an_ordinary_folder_has_no_gguf_weights(tmp_path: Path) -> None:
    assert gguf_weights_file(tmp_path) is None


def test_default_model_as_gguf() -> None:
    # The real cache, as tests/test_default_model.py uses: written once per machine.
    folder, gguf_path = default_gguf_model()
    assert gguf_path == find_default_gguf()
    assert gguf_weights_file(folder) == gguf_path.resolve()
    config = ModelConfig.from_pretrained(folder)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


@pytest.mark.slow
def test_default_model_reads_exactly() -> None:
    weights = assert_reads_as_gguf_dequantizes(find_default_gguf())
    kinds = {getattr(weight, "kind", None) for weight in weights.values()}
    assert kinds == {UINT4, INT8, None}  # Q4_1, the Q8_0 embedding, F32 norms
    embedding = weights["model.embed_tokens.weight"]
    assert isinstance(embedding, QuantizedWeight)
    assert embedding.shape == (49152, 576)
    assert np.prod(embedding.codes.shape) == 49152 * 576
