"""int8 KV pages: the Hadamard turn leaves the model's answers alone, the scheme's layout and
capacity, and what the engine says and refuses. Kernels against their twins are in
test_kernels.py and test_cpu_kernels.py; pages over the wire in test_kvtransfer.py; the
disaggregated path in test_workers.py."""

from __future__ import annotations

import logging

import pytest
import torch
from engines import build_engine
from tiny_models import build_tiny_model, random_prompts

from common.engine.kv_pool import kv_layout
from common.engine.llm_engine import LLMEngine
from common.kv_layout import KVLayout
from common.messages import from_wire, to_wire
from common.sampling_params import SamplingParams
from kernels.interface import FP8_DTYPE, INT8_DTYPE
from kernels.kv_formats import dequantize_int8, quantize_int8
from kernels.kv_turn import hadamard_turns, sylvester_hadamard, turn_scales

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
# The engines here: 128 pages, 64-token steps.
KNOBS = {"num_pages": 128, "max_num_batched_tokens": 64}


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_turns_undo_each_other_and_keep_dot_products(head_dim):
    query_turn, kv_turn = hadamard_turns(head_dim, torch.float32, "cpu")
    a, b = turn_scales(head_dim)
    assert a * b == 1 / head_dim and {a, b} <= {2.0**-k for k in range(8)}
    h = sylvester_hadamard(head_dim)
    assert torch.equal(h @ h, head_dim * torch.eye(head_dim))
    q, k = torch.randn(5, head_dim, dtype=torch.float64), torch.randn(7, head_dim)
    turned = query_turn.weight.double() @ kv_turn.weight.double().T
    torch.testing.assert_close(turned, torch.eye(head_dim, dtype=torch.float64))
    torch.testing.assert_close(
        query_turn(q.float()) @ kv_turn(k).T, q.float() @ k.T, rtol=1e-5, atol=1e-5
    )
    # bf16 holds every weight exactly: powers of two times one.
    for turn in hadamard_turns(head_dim, torch.bfloat16, "cpu"):
        assert torch.equal(turn.weight.float(), turn.weight.float().abs().max() * h.sign())


def greedy_samples(engine: LLMEngine, prompts: list[list[int]]) -> list[list]:
    samples = {engine.add_request(p, GREEDY, request_id=f"r{i}"): [] for i, p in enumerate(prompts)}
    while engine.has_unfinished:
        for output in engine.step():
            samples[output.request_id].extend(output.new_samples)
    return list(samples.values())


def test_a_turned_model_over_float32_pages_answers_as_the_model(tmp_path):
    """The turn alone, without int8 rounding: queries, keys and values turned and the output
    turned back change nothing but float32 rounding. Measured through the engine, turns on."""
    folder = build_tiny_model("qwen2-bias", tmp_path / "qwen2")
    prompts = random_prompts(3, seed=21, min_len=20, max_len=70)
    plain = greedy_samples(build_engine(folder, **KNOBS), prompts)
    turned_engine = build_engine(folder, **KNOBS)
    turned_engine.model.turn_kv_heads()
    turned = greedy_samples(turned_engine, prompts)
    for a, b in zip(plain, turned, strict=True):
        assert [s.token_id for s in a] == [s.token_id for s in b]
        logprobs = [[lp for _, lp in s.top_logprobs] for s in a]
        turned_logprobs = [[lp for _, lp in s.top_logprobs] for s in b]
        torch.testing.assert_close(
            torch.tensor(turned_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4
        )


def test_int8_rounding_is_within_half_a_step_after_the_turn():
    # Keys with outlier channels: before the turn the step is set by the outliers.
    keys = torch.randn(256, 2, 64)
    keys[..., [3, 40]] *= 30
    _, kv_turn = hadamard_turns(64, torch.float32, "cpu")
    for vectors in (keys, kv_turn(keys)):
        quantized, codes = quantize_int8(vectors)
        error = (dequantize_int8(quantized, codes) - vectors).abs()
        step = vectors.abs().amax(-1, keepdim=True) / 127
        # Half a step of the vector's own scale, which is at most 1/8 above amax / 127.
        assert (error <= step * 1.125 / 2 + 1e-6).all()
    plain_error = (dequantize_int8(*quantize_int8(keys)) - keys).norm()
    turned = kv_turn(keys)
    turned_error = (dequantize_int8(*quantize_int8(turned)) - turned).norm()
    assert turned_error < plain_error / 2


def test_int8_layout_holds_at_least_1_95_times_the_tokens_of_bf16():
    # The default model's shape: 30 layers, 3 KV heads of 64.
    shape = dict(page_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    bf16 = kv_layout(torch.bfloat16, **shape).bytes_per_page
    int8 = kv_layout(INT8_DTYPE, **shape)
    fp8 = kv_layout(FP8_DTYPE, **shape)
    assert int8.scale_page_nbytes == 30 * 2 * 16 * 3  # one byte per token, head, K and V
    assert bf16 / int8.bytes_per_page >= 1.95
    assert int8.mismatch(fp8) == "dtype: 'int8_hadamard' here vs 'float8_e4m3fn' there"
    assert from_wire(KVLayout, to_wire(int8)) == int8
    assert "int8 after a Hadamard turn" in int8.describe("bfloat16")
    assert "1.97x the tokens of bfloat16" in int8.describe("bfloat16")


def test_the_engine_reports_the_scheme_at_start_up(tmp_path, caplog):
    folder = build_tiny_model("llama3-rope", tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="common.engine.llm_engine"):
        engine = build_engine(folder, **KNOBS, kv_cache_dtype="int8", dtype="bfloat16")
    assert engine.pool.scales is not None and engine.pool.scales.dtype == torch.uint8
    assert engine.pool.data.dtype == INT8_DTYPE
    assert "int8 after a Hadamard turn, a one-byte scale per token and head" in caplog.text
    assert all(layer.self_attn.kv_turn is not None for layer in engine.model.layers)
    outputs = engine.generate(random_prompts(2, seed=3), SamplingParams(max_tokens=4))
    assert [len(tokens) for tokens in outputs] == [4, 4]


def test_a_head_dim_that_is_not_a_power_of_two_is_refused(tmp_path):
    folder = build_tiny_model("mistral", tmp_path / "mistral")  # head_dim 80
    with pytest.raises(ValueError, match="power-of-two head_dim, got 80"):
        build_engine(folder, **KNOBS, kv_cache_dtype="int8")
