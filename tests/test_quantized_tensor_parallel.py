"""Quantized checkpoints under tensor parallelism: each rank holds its rows or whole groups of
columns with their scales, a split that would cut a group is refused, and a TP group's greedy
tokens are the one-process engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_gguf import write_tiny_llama_gguf
from tiny_models import (
    assert_greedy_equal_up_to_near_ties,
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
)

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.model.loader import load_model
from common.model.parallel import TensorParallel
from common.model.quantization.writer import write_compressed_tensors
from common.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    base = save_tiny_model(
        tiny_llama_config(tie_word_embeddings=False), tmp_path_factory.mktemp("base") / "tiny"
    )
    return write_compressed_tensors(base, tmp_path_factory.mktemp("w4a16") / "m", "W4A16", 16)


def _dequantized(module) -> torch.Tensor:
    return module.qweight.dequantize()


@pytest.mark.parametrize("kind", ["w4a16", "gguf"])
def test_ranks_hold_slices_that_make_up_the_whole_layer(w4a16, tmp_path, kind):
    folder = w4a16
    if kind == "gguf":
        path = write_tiny_llama_gguf(tmp_path / "q4k.gguf", GGMLQuantizationType.Q4_K, tied=True)
        folder = resolve_model_path(path)
    config = ModelConfig.from_pretrained(folder)
    whole = load_model(config, torch.float32, CPU)
    ranks = [load_model(config, torch.float32, CPU, tp=TensorParallel(r, 2)) for r in range(2)]
    for index, layer in enumerate(whole.decoder_layers()):
        parts = [model.decoder_layers()[index] for model in ranks]
        o_proj = torch.cat([_dequantized(p.self_attn.o_proj) for p in parts], dim=1)
        assert torch.equal(o_proj, _dequantized(layer.self_attn.o_proj))
        down = torch.cat([_dequantized(p.mlp.down_proj) for p in parts], dim=1)
        assert torch.equal(down, _dequantized(layer.mlp.down_proj))
        width = config.intermediate_size // 2
        gates = torch.cat([_dequantized(p.mlp.gate_up_proj)[:width] for p in parts])
        assert torch.equal(gates, _dequantized(layer.mlp.gate_up_proj)[: 2 * width])
    if kind == "gguf":  # the quantized table: each rank its rows of the vocabulary
        table = torch.cat([model.embed_tokens.table.dequantize() for model in ranks])
        assert torch.equal(table[: config.vocab_size], whole.embed_tokens.table.dequantize())


def test_a_split_that_cuts_a_group_is_refused(tmp_path):
    base = save_tiny_model(tiny_llama_config(), tmp_path / "base")
    # o_proj's 64 inputs in one group of 64: two ranks of 32 inputs would each hold half of it.
    folder = write_compressed_tensors(base, tmp_path / "w4a16", "W4A16", group_size=64)
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"o_proj.weight cannot be split over 2 ranks"):
        load_model(config, torch.float32, CPU, tp=TensorParallel(1, 2))


@pytest.mark.slow
def test_tp2_greedy_tokens_equal_one_process(w4a16):
    config = EngineConfig(
        model=str(w4a16),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_pages=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=48, max_model_len=256),
    )
    prompts = random_prompts(4, seed=11)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = []
    for size in (1, 2):
        engine = LLMEngine(dataclasses.replace(config, tensor_parallel_size=size))
        try:
            outputs.append(engine.generate(prompts, greedy))
        finally:
            engine.close()
    one, two = outputs
    # The reference for near ties: the checkpoint as transformers reads it.
    assert_greedy_equal_up_to_near_ties(w4a16, prompts, two, one, 1e-3)
