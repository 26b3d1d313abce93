"""The simulated engine: a cost model's step times over the real scheduler, one process
(tests/test_planner_cluster.py runs a cluster of simulated workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import build_tiny_chat_model

from common.config import EngineConfig, SchedulerConfig
from common.cost_model import CostModel
from common.engine.llm_engine import LLMEngine
from common.engine.simulated import SimulatedRunner
from common.sampling_params import SamplingParams

COST = {"fixed_s": 0.002, "per_token_s": 2e-5, "per_seq_s": 1e-4, "kv_tokens": 8192}


def write_cost(folder: Path, **fields) -> Path:
    path = folder / "cost.json"
    path.write_text(json.dumps({**COST, **fields}))
    return path


def expected_tokens(runner: SimulatedRunner, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(runner.token_after(tokens))
    return tokens[len(prompt) :]


def test_cost_model_refuses_nonsense(tmp_path):
    assert CostModel.load(write_cost(tmp_path)).step_seconds(100, 2, 0) == pytest.approx(
        0.002 + 100 * 2e-5 + 2 * 1e-4
    )
    with pytest.raises(ValueError, match="per_token_s"):
        CostModel.load(write_cost(tmp_path, per_token_s=-1.0))
    with pytest.raises(ValueError, match="unknown fields"):
        CostModel.load(write_cost(tmp_path, per_flop_s=1.0))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        CostModel.load(tmp_path / "bad.json")


def test_steps_take_the_cost_models_time_and_answer_deterministically(tmp_path):
    folder = build_tiny_chat_model(tmp_path / "tiny")
    config = EngineConfig(
        model=str(folder),
        simulated_engine=str(write_cost(tmp_path)),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    engine = LLMEngine(config)
    prompts = [list(range(5, 105)), [7, 8, 9]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    runner = engine.runner
    assert isinstance(runner, SimulatedRunner)
    # Runs to max_tokens (no end-of-sequence token is ever drawn), the same tokens as asked
    # one at a time.
    assert outputs == [expected_tokens(runner, p, 6) for p in prompts]
    # 103 prompt tokens in 64-token chunks: 2 prefill steps, then 5 decode steps of both rows.
    # Each step's time is the model's for what it held.
    assert engine.page_manager.num_free_pages == engine.page_manager.num_pages
    assert runner.slept_s >= 7 * COST["fixed_s"]
    assert runner.slept_s == pytest.approx(
        7 * COST["fixed_s"]
        + (103 + 5 * 2) * COST["per_token_s"]
        + (2 + 1 + 5 * 2) * COST["per_seq_s"]
        - COST["per_seq_s"],  # the first chunk held one row (the long prompt alone)
        rel=0.2,
    )
