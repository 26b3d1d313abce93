"""Tiny llama GGUF files for the tests, their weights of any GGML type, with a real tokenizer.

The weights are random block bytes, valid for their type: every fp16 field (d, dmin, m) is a
finite number and every other byte is uniform, so each code of each format appears. That reaches
the K-quants, which the gguf package cannot quantize, and every bit of every code layout.

The tokenizer is a byte-level BPE like SmolLM2's, cut down to ``VOCAB_SIZE`` tokens: its three
control tokens, the 256 byte symbols, and merges that spell a few English words.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from tokenizers.pre_tokenizers import ByteLevel

HIDDEN = 256  # K-quant blocks are 256 wide: every weight's input must hold whole ones
INTERMEDIATE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS
VOCAB_SIZE = 300
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = [
    "Ġthe",
    "Ġcapital",
    "Ġof",
    "ĠFrance",
    "Ġis",
    "ĠParis",
    "Hello",
    "Ġworld",
    "ing",
    "Ġand",
    "Ġtoken",
]

# Byte offsets of each block format's fp16 fields (ggml-common.h's block structs).
_FP16_FIELDS = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def gguf_shapes(tied: bool = False) -> dict[str, tuple[int, int] | tuple[int]]:
    """Every tensor of the tiny llama, GGUF name -> numpy shape ``[out, in]``."""
    shapes: dict[str, tuple[int, int] | tuple[int]] = {
        "token_embd.weight": (VOCAB_SIZE, HIDDEN),
        "output_norm.weight": (HIDDEN,),
    }
    if not tied:
        shapes["output.weight"] = (VOCAB_SIZE, HIDDEN)
    for layer in range(NUM_LAYERS):
        shapes |= {
            f"blk.{layer}.attn_norm.weight": (HIDDEN,),
            f"blk.{layer}.ffn_norm.weight": (HIDDEN,),
            f"blk.{layer}.attn_q.weight": (NUM_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_k.weight": (NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_v.weight": (NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_output.weight": (HIDDEN, NUM_HEADS * HEAD_DIM),
            f"blk.{layer}.ffn_gate.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{layer}.ffn_up.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{layer}.ffn_down.weight": (HIDDEN, INTERMEDIATE),
        }
    return shapes


def write_tiny_llama_gguf(
    path: Path,
    weight_type: GGMLQuantizationType,
    types: Mapping[str, GGMLQuantizationType] | None = None,
    *,
    tied: bool = False,
    seed: int = 0,
) -> Path:
    """A tiny llama GGUF at `path`: its 2-D weights of `weight_type` (`types` overrides by GGUF
    tensor name), its norms F32, random values drawn from `seed`."""
    rng = np.random.default_rng(seed)
    types = types or {}
    writer = GGUFWriter(path, "llama")
    _add_metadata(writer)
    for name, shape in gguf_shapes(tied).items():
        kind = types.get(name, weight_type if len(shape) == 2 else GGMLQuantizationType.F32)
        writer.add_tensor(name, random_tensor(rng, shape, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], kind: GGMLQuantizationType
) -> np.ndarray:
    """Random values of GGUF type `kind` for a tensor of numpy shape `shape`: typed for F32 and
    F16, else the raw bytes ``[..., bytes of a row]`` the writer takes with ``raw_dtype``."""
    values = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
    if kind == GGMLQuantizationType.F32:
        return values
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if kind == GGMLQuantizationType.BF16:
        return (
            (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
        )
    block_size, block_bytes = GGML_QUANT_SIZES[kind]
    *outer, width = shape
    blocks = rng.integers(0, 256, size=(*outer, width // block_size, block_bytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[kind]:
        field = rng.normal(0.0, 0.01, size=blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset : offset + 2] = field[..., None].view(np.uint8)
    return blocks.reshape(*outer, -1)


def tiny_tokenizer_metadata() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and llama.cpp token types (3: control, 1: normal) of the tiny tokenizer."""
    tokens = CONTROL_TOKENS + sorted(ByteLevel.alphabet())
    merges: list[str] = []
    for word in _WORDS:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if word[:end] not in tokens and len(tokens) < VOCAB_SIZE:
                merges.append(f"{left} {right}")
                tokens.append(word[:end])
    assert len(tokens) == VOCAB_SIZE, f"{len(tokens)} tokens: add words to reach {VOCAB_SIZE}"
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, merges, types


def _add_metadata(writer: GGUFWriter) -> None:
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_rope_dimension_count(HEAD_DIM)
    tokens, merges, types = tiny_tokenizer_metadata()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
