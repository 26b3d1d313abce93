"""A GGUF file served as it is: every block type pdserve reads gives, in float32, the greedy
tokens of ``transformers`` over the same file dequantized by the gguf package itself."""

from __future__ import annotations

import pytest
import torch
from engines import build_engine
from gguf import GGMLQuantizationType
from tiny_gguf import VOCAB_SIZE, write_tiny_llama_gguf
from tiny_models import assert_greedy_equal_up_to_near_ties, hf_greedy

from common.config import ModelConfig
from common.model.default_model import dequantize_gguf, resolve_model_path
from common.model.loader import load_model
from common.model.quantized_layers import QuantizedEmbedding
from common.sampling_params import SamplingParams
from kernels.quantized import QuantizedLinear

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Weight-only formats: the same weights summed in another order part only at last-bit ties.
TIE = 1e-3
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (5, 17, 40)]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", TYPES)
def test_gguf_type_gives_the_greedy_tokens_of_its_dequantized_model(tmp_path, kind, tied):
    path = write_tiny_llama_gguf(
        tmp_path / f"{kind}.gguf", GGMLQuantizationType[kind], tied=tied, seed=1
    )
    # Every tensor dequantized by the gguf package: the reference the kernels must agree with.
    reference = dequantize_gguf(path, tmp_path / "dequantized", "float32")
    prompts = _prompts()
    expected = hf_greedy(reference, prompts, NEW_TOKENS)
    engine = build_engine(resolve_model_path(path), max_num_batched_tokens=2048)
    got = engine.generate(prompts, GREEDY)
    assert_greedy_equal_up_to_near_ties(reference, prompts, got, expected, TIE)
    engine.close()


def test_gguf_layers_keep_their_blocks(tmp_path):
    """Q4_K's layers stay 4-bit codes, and the quantized table is looked up (and, tied, is the
    output projection) without a 16-bit copy of it."""
    path = write_tiny_llama_gguf(tmp_path / "q4k.gguf", GGMLQuantizationType.Q4_K, tied=True)
    model = load_model(
        ModelConfig.from_pretrained(resolve_model_path(path)), torch.float32, torch.device("cpu")
    )
    qkv = model.decoder_layers()[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.qweight.kind == "uint4"
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.head, QuantizedLinear)
    assert model.head.qweight is model.embed_tokens.table


def test_quantization_flag_names_gguf(tmp_path):
    from common.model.quantization import quantization_method

    path = write_tiny_llama_gguf(tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0)
    config = ModelConfig.from_pretrained(resolve_model_path(path))
    assert quantization_method(config) == "gguf"
    assert quantization_method(config, "gguf") == "gguf"
    with pytest.raises(ValueError, match=r"--quantization compressed-tensors: .* is gguf"):
        quantization_method(config, "compressed-tensors")


def test_a_bf16_gguf_engine_plans_its_pool(tmp_path):
    """In bf16 every tensor of a GGUF model may be held by the C kernels' modules (none a
    parameter): the pool is still planned from its memory and the engine serves."""
    path = write_tiny_llama_gguf(tmp_path / "q4_1.gguf", GGMLQuantizationType.Q4_1, tied=True)
    engine = build_engine(
        resolve_model_path(path), dtype="bfloat16", num_pages=None, kv_cache_memory=16 << 20
    )
    assert len(engine.generate(_prompts(), GREEDY)[0]) == NEW_TOKENS
    engine.close()


def test_later_loads_read_the_stored_blocks_and_a_damaged_copy_is_rewritten(tmp_path, monkeypatch):
    import common.model.gguf_weights as gguf_weights
    from common.model.gguf_blocks import BLOCKS_FILE

    path = write_tiny_llama_gguf(tmp_path / "q6k.gguf", GGMLQuantizationType.Q6_K, tied=False)
    folder = resolve_model_path(path)
    config = ModelConfig.from_pretrained(folder)
    first = load_model(config, torch.float32, torch.device("cpu"))
    assert (folder / BLOCKS_FILE).is_file()

    def unread(*_args):
        raise AssertionError("the GGUF file was read again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_weights, "read_gguf_weights", unread)
        second = load_model(config, torch.float32, torch.device("cpu"))
    for a, b in zip(first.decoder_layers(), second.decoder_layers(), strict=True):
        assert torch.equal(
            a.mlp.down_proj.qweight.dequantize(), b.mlp.down_proj.qweight.dequantize()
        )
    assert torch.equal(first.head.qweight.dequantize(), second.head.qweight.dequantize())
    (folder / BLOCKS_FILE).write_bytes(b"not a safetensors file")
    third = load_model(config, torch.float32, torch.device("cpu"))
    assert torch.equal(
        first.decoder_layers()[1].self_attn.qkv_proj.qweight.dequantize(),
        third.decoder_layers()[1].self_attn.qkv_proj.qweight.dequantize(),
    )
    assert (folder / BLOCKS_FILE).stat().st_size > 1000  # written again
