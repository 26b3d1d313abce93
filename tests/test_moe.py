"""Mixtures of experts: configs read (or refused), routing, the loader's expert slices, and
engines whose greedy tokens are transformers' (the families' one-process equivalence, eager
and packed, bf16, chunked, is in test_engine_equivalence.py, whose FAMILIES include the four
mixtures).

Near ties: a token's experts are a top-k over softmax probabilities, so two experts whose
probabilities nearly tie could swap under another summation order and change the token. The
tiny models' wide initialisation keeps router logits well apart; tensor-parallel runs, which
sum in another order, are compared up to near ties of the final logits as the dense ones are.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from determinism import assert_answers_are_invariant
from engines import build_engine, tp_engine_config
from safetensors.torch import load_file, save_file
from tiny_models import (
    assert_greedy_equal_up_to_near_ties,
    build_tiny_model,
    hf_greedy,
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
)

from common.config import ModelConfig
from common.engine.args import add_engine_args, engine_config_from_args
from common.engine.llm_engine import LLMEngine
from common.model.default_model import ensure_default_model
from common.model.loader import load_model
from common.model.moe import SparseMoE, route
from common.model.parallel import TensorParallel, check_shardable
from common.model.quantization.writer import write_compressed_tensors
from common.sampling_params import SamplingParams
from kernels.cpu.quantized_linear import CpuQuantizedLinear
from kernels.layer_kernels import CudaQuantizedKernels, fused_triton_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return build_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2-moe", tmp_path_factory.mktemp("qwen2-moe"))


def edited_config(source: Path, folder: Path, **fields) -> Path:
    """A copy of the model folder ``source`` whose config.json has ``fields`` over it."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))
    return folder


# -- configs -------------------------------------------------------------------------------------


def test_each_family_reads_its_experts(mixtral, qwen2_moe, tmp_path):
    moe = ModelConfig.from_pretrained(mixtral).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 96)
    assert moe.renormalize and moe.sparse_layers == {0, 1}
    assert moe.shared_expert_intermediate_size == 0
    moe = ModelConfig.from_pretrained(qwen2_moe).moe
    assert moe is not None
    assert (moe.num_experts, moe.expert_intermediate_size) == (6, 32)
    assert not moe.renormalize and moe.shared_expert_intermediate_size == 96
    qwen3 = build_tiny_model("qwen3-moe", tmp_path / "qwen3", num_hidden_layers=4)
    moe = ModelConfig.from_pretrained(qwen3).moe
    assert moe is not None and moe.renormalize and moe.sparse_layers == {1, 2, 3}
    stepped = build_tiny_model(
        "qwen3-moe", tmp_path / "stepped", num_hidden_layers=4, decoder_sparse_step=2,
        mlp_only_layers=[],
    )  # fmt: skip
    moe = ModelConfig.from_pretrained(stepped).moe
    assert moe is not None and moe.sparse_layers == {1, 3}
    model = load_model(ModelConfig.from_pretrained(stepped), torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.decoder_layers()]
    assert kinds == ["MLP", "SparseMoE", "MLP", "SparseMoE"]
    assert ModelConfig.from_pretrained(build_tiny_model("mistral", tmp_path / "dense")).moe is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_local_experts": 0}, "num_local_experts"),
    ],
)
def test_a_field_pdserve_does_not_compute_refuses_the_model_by_name(
    mixtral, tmp_path, fields, named
):
    folder = edited_config(mixtral, tmp_path / "edited", **fields)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(folder)


def test_a_dense_family_refuses_another_familys_field(tmp_path):
    folder = build_tiny_model("llama3-rope", tmp_path / "llama", clip_qkv=8.0)
    with pytest.raises(ValueError, match="clip_qkv"):
        ModelConfig.from_pretrained(folder)


def test_shards_are_checked_against_experts(mixtral):
    config = ModelConfig.from_pretrained(mixtral)
    check_shardable(config, 2, expert_parallel=True)
    check_shardable(config, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="8 experts"):
        check_shardable(config, 3, expert_parallel=True)  # 96 divides by 3: experts do not


def test_expert_parallel_needs_experts(tmp_path):
    dense = ModelConfig.from_pretrained(build_tiny_model("mistral", tmp_path / "dense"))
    with pytest.raises(ValueError, match="has no experts"):
        check_shardable(dense, 2, expert_parallel=True)


# -- routing and the layer -----------------------------------------------------------------------


def test_routing_takes_the_top_k_and_renormalises_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probabilities = torch.softmax(logits, dim=-1)[0]
    weights, chosen = route(logits, 2, renormalize=False)
    assert chosen.tolist() == [[1, 2]]
    assert torch.equal(weights[0], probabilities[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    expected = probabilities[[1, 2]] / probabilities[[1, 2]].sum()
    assert torch.allclose(weights[0], expected) and weights.dtype == torch.float32


def test_a_layer_reads_only_the_experts_its_tokens_chose(mixtral):
    model = load_model(ModelConfig.from_pretrained(mixtral), torch.float32, torch.device("cpu"))
    layer = model.decoder_layers()[0].mlp
    assert isinstance(layer, SparseMoE)
    ran: list[int] = []
    for index, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda *_, index=index: ran.append(index))
    x = torch.randn(3, 64)
    _, chosen = route(layer.gate(x), 2, renormalize=True)
    out = layer(x)
    assert ran == sorted(set(chosen.flatten().tolist()))
    # The sum, by hand: each token's experts' outputs weighted by their routing weights.
    weights, _ = route(layer.gate(x), 2, renormalize=True)
    for token in range(3):
        by_hand = sum(
            weights[token, slot] * layer.experts[int(chosen[token, slot])](x[token : token + 1])
            for slot in range(2)
        )
        assert torch.allclose(out[token], by_hand[0], atol=1e-6)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_fused_triton_experts_compute_the_layer_the_loop_does(mixtral, expert_parallel):
    """The CUDA kernels' twin of a layer's experts (stacked weights, one Triton kernel; run by
    the interpreter here) against the layer's own expert-by-expert loop, float32; with expert
    parallelism, over rank 1's half of the experts only."""
    tp = TensorParallel(1, 2, expert_parallel=True) if expert_parallel else None
    model = load_model(ModelConfig.from_pretrained(mixtral), torch.float32, DEVICE, tp=tp)
    layer = model.decoder_layers()[0].mlp
    assert isinstance(layer, SparseMoE)
    x = torch.randn(5, 64, device=DEVICE)
    weights, chosen = route(layer.gate(x), 2, renormalize=True)
    looped = layer.run_experts(x, chosen, weights)
    fused = fused_triton_experts(list(layer.experts), layer.first_expert)
    assert fused is not None
    torch.testing.assert_close(fused(x, chosen, weights).float(), looped, atol=1e-5, rtol=1e-5)
    layer.use_kernels(CudaQuantizedKernels())
    assert layer.fused_experts is not None and len(layer.experts) == 0


# -- the loader ----------------------------------------------------------------------------------


def test_expert_parallel_ranks_hold_whole_experts_and_tensor_parallel_ones_slices(mixtral):
    config = ModelConfig.from_pretrained(mixtral)
    whole = load_model(config, torch.float32, torch.device("cpu"))
    cpu = torch.device("cpu")
    for rank in range(2):
        experts_whole = TensorParallel(rank, 2, expert_parallel=True)
        ep = load_model(config, torch.float32, cpu, tp=experts_whole)
        tp = load_model(config, torch.float32, cpu, tp=TensorParallel(rank, 2))
        for ours, ep_layer, tp_layer in zip(
            whole.decoder_layers(), ep.decoder_layers(), tp.decoder_layers(), strict=True
        ):
            assert isinstance(ep_layer.mlp, SparseMoE) and isinstance(tp_layer.mlp, SparseMoE)
            assert isinstance(ours.mlp, SparseMoE)
            assert len(ep_layer.mlp.experts) == 4 and len(tp_layer.mlp.experts) == 8
            assert torch.equal(ep_layer.mlp.gate.weight, ours.mlp.gate.weight)
            for local, expert in enumerate(ep_layer.mlp.experts):
                held = ours.mlp.experts[4 * rank + local]
                assert torch.equal(expert.down_proj.weight, held.down_proj.weight)
                assert torch.equal(expert.gate_up_proj.weight, held.gate_up_proj.weight)
            for expert, held in zip(tp_layer.mlp.experts, ours.mlp.experts, strict=True):
                columns = slice(48 * rank, 48 * (rank + 1))
                assert torch.equal(expert.down_proj.weight, held.down_proj.weight[:, columns])
                gate, up = held.gate_up_proj.weight.chunk(2)
                both = torch.cat([gate[columns], up[columns]])
                assert torch.equal(expert.gate_up_proj.weight, both)


def test_dummy_weights_take_a_moe_config(mixtral):
    config = ModelConfig.from_pretrained(mixtral)
    model = load_model(config, torch.float32, torch.device("cpu"), "dummy")
    layer = model.decoder_layers()[1].mlp
    assert isinstance(layer, SparseMoE)
    assert layer.experts[7].down_proj.weight.shape == (64, 96)
    assert 0.01 < float(layer.experts[7].down_proj.weight.detach().std()) < 0.03


# -- engines -------------------------------------------------------------------------------------


def upcycled(dense: Path, folder: Path, num_experts: int, top_k: int) -> Path:
    """The Llama model in ``dense`` as a Mixtral of ``num_experts`` experts, each its dense MLP,
    under a random router that picks ``top_k`` of them: any mix of identical experts is the
    MLP, so it must answer as the dense model does."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (dense / name).is_file():
            shutil.copy(dense / name, folder / name)
    config = json.loads((dense / "config.json").read_text())
    config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    config |= {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
    (folder / "config.json").write_text(json.dumps(config))
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(dense.glob("*.safetensors")):
        tensors |= load_file(path)
    generator = torch.Generator().manual_seed(0)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        mlp = {p: tensors.pop(f"{prefix}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")}
        for expert in range(num_experts):
            for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                name = f"{prefix}.block_sparse_moe.experts.{expert}.{ours}.weight"
                tensors[name] = mlp[theirs].clone()
        router = torch.randn(num_experts, config["hidden_size"], generator=generator)
        tensors[f"{prefix}.block_sparse_moe.gate.weight"] = router.to(mlp["gate"].dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_default_model_upcycled_into_identical_experts_answers_as_the_dense_one(tmp_path):
    """SmolLM2 as a Mixtral of four experts choosing two, in bf16: the sum of the two weighted
    outputs is rounded once, so it is the MLP's bits. Both engines run deterministic mode, whose
    GEMMs sum a row alike whatever rows run beside it (an expert sees fewer rows than the
    dense MLP)."""
    dense = ensure_default_model(progress=False)
    folder = upcycled(dense, tmp_path / "upcycled", num_experts=4, top_k=2)
    prompts = random_prompts(3, seed=5, min_len=8, max_len=30)
    knobs = {"dtype": "bfloat16", "deterministic": True, "max_model_len": 256}
    expected = build_engine(dense, **knobs).generate(prompts, GREEDY)
    assert build_engine(folder, **knobs).generate(prompts, GREEDY) == expected


def test_a_mixtral_window_shorter_than_the_prompt_answers_as_transformers(tmp_path):
    """Mixtral slides on every layer, as Mistral: prompts and answers past a 16-token window."""
    folder = build_tiny_model("mixtral", tmp_path / "mixtral-window", sliding_window=16)
    prompts = random_prompts(3, seed=21, min_len=30, max_len=50)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    assert build_engine(folder).generate(prompts, GREEDY) == expected


def test_deterministic_mode_and_speculation_hold_with_experts(qwen2_moe):
    """Alone, batched, chunked, cached and speculated (n-gram): the same bits, in bf16."""
    assert_answers_are_invariant(qwen2_moe, dtype="bfloat16", max_tokens=8)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8_bit_kv_serves_a_mixture_as_its_dense_twin(tmp_path, kv_cache_dtype):
    """8-bit pages round keys and values, so transformers is no reference; a mixture of
    identical experts choosing one (weight exactly 1) is: over the same pages it must give its
    dense model's tokens exactly."""
    dense = save_tiny_model(tiny_llama_config(), tmp_path / "dense")
    folder = upcycled(dense, tmp_path / "upcycled", num_experts=4, top_k=1)
    prompts = random_prompts(4, seed=11)
    expected = build_engine(dense, kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY)
    engine = build_engine(folder, kv_cache_dtype=kv_cache_dtype)
    assert engine.generate(prompts, GREEDY) == expected


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16", "FP8_DYNAMIC"])
def test_quantized_experts_serve_as_their_dense_twin(tmp_path, scheme):
    """``pdserve quantize`` quantizes every expert (the router stays 16-bit, as llm-compressor
    leaves it), and the experts run on the quantized kernels: a mixture of identical experts
    choosing one, quantized, holds the same codes as its quantized dense model, and must give its
    tokens exactly."""
    dense = save_tiny_model(tiny_llama_config(), tmp_path / "dense")
    mixture = upcycled(dense, tmp_path / "upcycled", num_experts=4, top_k=1)
    folders = [
        write_compressed_tensors(source, tmp_path / f"{source.name}-{scheme}", scheme, 32)
        for source in (dense, mixture)
    ]
    prompts = random_prompts(4, seed=13)
    expected = build_engine(folders[0]).generate(prompts, GREEDY)
    engine = build_engine(folders[1])
    layer = engine.model.decoder_layers()[0].mlp
    assert isinstance(layer, SparseMoE) and isinstance(
        layer.experts[3].down_proj, CpuQuantizedLinear
    )
    assert engine.generate(prompts, GREEDY) == expected


@pytest.mark.slow  # two engines of two processes each
@pytest.mark.parametrize("family", ["qwen2-moe", "olmoe"])
def test_tensor_and_expert_parallel_engines_answer_as_transformers(tmp_path, family):
    """TP 2 splitting every expert, and TP 2 with the experts whole (expert parallelism); OLMoE
    with one KV head, which both ranks hold, so its whole-projection k norm must not count
    that head twice."""
    overrides = {"num_key_value_heads": 1} if family == "olmoe" else {}
    folder = build_tiny_model(family, tmp_path / family, **overrides)
    prompts = random_prompts(4, seed=3)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    for expert_parallel in (False, True):
        engine = LLMEngine(tp_engine_config(folder, 2, enable_expert_parallel=expert_parallel))
        try:
            got = engine.generate(prompts, GREEDY)
        finally:
            engine.close()
        assert_greedy_equal_up_to_near_ties(folder, prompts, got, expected)


def test_the_expert_parallel_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--enable-expert-parallel", "-tp", "2"]))
    assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    assert not engine_config_from_args(parser.parse_args([])).enable_expert_parallel
