"""How a llama GGUF maps onto a Hugging Face Llama: config, tokenizer, tensor names, q/k rows.

llama.cpp's converter renames every tensor, interleaves the halves of each q/k head's rows for
its RoPE, and moves config and tokenizer into GGUF metadata. This module undoes each of those,
for the bf16 conversion and the quantized reader alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFReader, ReaderTensor
    from transformers import LlamaConfig, PreTrainedTokenizerFast

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


def write_hf_metadata(reader: GGUFReader, out_dir: Path) -> LlamaConfig:
    """Write config.json, generation_config.json and the tokenizer files (chat template
    included) for the llama GGUF `reader` reads, and return the config."""
    from transformers import GenerationConfig

    config = llama_config(reader)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    # The chat template goes into tokenizer_config.json rather than a separate .jinja file, so
    # readers that only know tokenizer_config.json find it too.
    build_tokenizer(reader, config).save_pretrained(out_dir, save_jinja_files=False)
    return config


def read_field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"GGUF file has no metadata key {key!r}")
    return field.contents()


def llama_config(reader: GGUFReader) -> LlamaConfig:
    from transformers import LlamaConfig

    arch = read_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
        vocab_size=read_field(reader, "llama.vocab_size"),
        hidden_size=read_field(reader, "llama.embedding_length"),
        intermediate_size=read_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=read_field(reader, "llama.block_count"),
        num_attention_heads=read_field(reader, "llama.attention.head_count"),
        num_key_value_heads=read_field(reader, "llama.attention.head_count_kv"),
        head_dim=read_field(reader, "llama.rope.dimension_count"),
        max_position_embeddings=read_field(reader, "llama.context_length"),
        rms_norm_eps=_shortest_float(read_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": _shortest_float(read_field(reader, "llama.rope.freq_base")),
        },
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=read_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _shortest_float(value: float) -> float:
    # GGUF stores float32, so 1e-5 reads back as 9.999999747e-06; the shortest decimal that
    # round-trips through float32 gives config.json the value the original model states.
    import numpy as np

    return float(str(np.float32(value)))


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    layer, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"


def rope_heads(hf_name: str, config: LlamaConfig) -> int | None:
    """How many heads' rows llama.cpp interleaved in tensor `hf_name` (None: it left it alone)."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return config.num_key_value_heads
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows.

    Hugging Face Llama rotates the two halves of each head (rotate_half); llama.cpp rotates
    adjacent pairs, so its converter interleaves each head's two halves. Reading the rows back
    as (head, pair, half) and swapping to (head, half, pair) restores the original order. Only
    whole rows move, so this applies as well to rows of codes or of per-row group scales.
    """
    rows, cols = weight.shape
    per_head = rows // num_heads
    return weight.reshape(num_heads, per_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def check_tensor_names(names: Iterable[str], config: LlamaConfig) -> None:
    """Raise ValueError unless `names` are exactly the Hugging Face tensors `config` needs."""
    names = set(names)
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    for layer in range(config.num_hidden_layers):
        expected |= {f"model.layers.{layer}.{part}.weight" for part in _LAYER_TENSORS.values()}
    if names != expected:
        missing = sorted(expected - names)[:5]
        extra = sorted(names - expected)[:5]
        raise ValueError(f"GGUF tensors do not match the config: missing {missing}, extra {extra}")


def build_tokenizer(reader: GGUFReader, config: LlamaConfig) -> PreTrainedTokenizerFast:
    """SmolLM2's byte-level BPE tokenizer, rebuilt from the vocabulary and merges in the GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = read_field(reader, "tokenizer.ggml.pre")
    if read_field(reader, "tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise ValueError(f"expected SmolLM's byte-level BPE tokenizer, got pre-tokenizer {pre!r}")
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in read_field(reader, "tokenizer.ggml.merges")]
    token_types = read_field(reader, "tokenizer.ggml.token_type")

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
        bos_token=tokens[read_field(reader, "tokenizer.ggml.bos_token_id")],
        eos_token=tokens[read_field(reader, "tokenizer.ggml.eos_token_id")],
        pad_token=tokens[read_field(reader, "tokenizer.ggml.padding_token_id")],
        unk_token=tokens[read_field(reader, "tokenizer.ggml.unknown_token_id")],
        chat_template=read_field(reader, "tokenizer.chat_template"),
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


# The GGML types pdserve reads: dense ones as they are, block ones translated exactly into
# QuantizedWeight (common/model/gguf_weights.py's _TRANSLATIONS, one per type).
# By name: this module is read where the gguf package is not imported (the router).
DENSE_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def check_gguf_weights(reader: GGUFReader, config: LlamaConfig) -> None:
    """Raise ValueError unless `reader`'s tensors are the ones `config` needs, each of a type
    ``common/model/gguf_weights.py`` reads: checked without torch, when a folder is written
    (by the launcher or the router, which never load it)."""
    check_tensor_names((hf_tensor_name(tensor.name) for tensor in reader.tensors), config)
    for tensor in reader.tensors:
        _check_readable(tensor)


def _supported_types() -> list[str]:
    """The GGML tensor types ``read_gguf_weights`` reads, by name."""
    return [*DENSE_TYPES, *BLOCK_TYPES]


def _check_readable(tensor: ReaderTensor) -> None:
    kind = tensor.tensor_type
    if kind.name in DENSE_TYPES:
        return
    if kind.name not in BLOCK_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is of type {kind.name}, which pdserve does not read "
            f"(it reads {', '.join(_supported_types())})"
        )
    if tensor.data.ndim != 2:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is a {tensor.data.ndim}-D {kind.name} tensor; "
            "pdserve reads quantized tensors only as 2-D weights"
        )
