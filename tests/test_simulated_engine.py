"""The simulated engine: a cost model's step times over the real scheduler, and a cluster of
simulated workers serving through router -> prefill -> decode on the real wire."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from cluster_harness import running_cluster
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


@pytest.fixture(scope="module")
def simulated_cluster(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    cost = write_cost(tmp_path_factory.mktemp("cost"))
    log = tmp_path_factory.mktemp("logs") / "up.log"
    flags = ("--prefill", "2", "--decode", "2", "--remote-prefill-min-tokens", "1")
    flags += ("--simulated-engine", str(cost), "--max-model-len", "1024")
    with running_cluster(folder, log, *flags) as base:
        yield base, folder, cost


def test_simulated_workers_serve_through_prefill_and_decode(simulated_cluster, tmp_path):
    base, folder, cost = simulated_cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    runner = SimulatedRunner(CostModel.load(cost), 49152, set())
    engine = LLMEngine(EngineConfig(model=str(folder), simulated_engine=str(cost)))
    runner.eos = frozenset(engine.model_config.eos_token_ids)
    for length in (40, 200, 300):
        prompt = [(i * 13 + length) % 4000 + 10 for i in range(length)]
        result = client.completions.create(
            model=folder.name,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            extra_body={"return_token_ids": True},
        )
        choice = result.choices[0]
        assert choice.token_ids == expected_tokens(runner, prompt, 12)
        assert choice.finish_reason == "length"
    # The prompts went through the prefill workers, whose pages went to decode over the wire.
    workers = json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())
    assert len(workers["prefill"]) == 2 and len(workers["decode"]) == 2
    computed = 0.0
    for worker in workers["prefill"]:
        text = urllib.request.urlopen(worker["metrics_url"], timeout=10).read().decode()
        match = re.search(r"^pdserve_prompt_tokens_computed_total (\S+)$", text, re.MULTILINE)
        computed += float(match.group(1)) if match else 0.0
    assert computed >= 40 + 200 + 300 - 3 * 16  # less at most a cached page each


def test_the_router_shows_the_planner_its_traffic_and_step_figures(simulated_cluster):
    base, folder, _ = simulated_cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    for length in (50, 150):
        client.completions.create(
            model=folder.name, prompt=[11] * length, max_tokens=5, temperature=0.0
        )
    traffic = json.loads(urllib.request.urlopen(f"{base}/v1/traffic?window_s=300").read())
    assert {(a["prompt_tokens"], a["max_tokens"]) for a in traffic["arrivals"]} >= {
        (50, 5),
        (150, 5),
    }
    finished = [f for f in traffic["finished"] if f["output_tokens"] == 5]
    assert len(finished) >= 2
    assert all(f["ttft_s"] > 0 and f["tpot_s"] > 0 and f["reason"] == "length" for f in finished)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/v1/traffic?window_s=-1")
    assert refused.value.code == 400
    # Each heartbeat carries the steps' time, tokens and rows summed: a worker that stepped
    # shows them (heartbeats come every second or so: wait for one after the requests).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())
        everyone = workers["prefill"] + workers["decode"]
        stepped = [w["steps"] for w in everyone if w["steps"]["count"]]
        if stepped and all(s["busy_seconds"] > 0 and s["tokens"] >= s["rows"] > 0 for s in stepped):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no step figures in {workers}")
