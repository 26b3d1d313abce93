"""The planner against a running cluster of simulated workers: it observes the router over HTTP,
fits the pools' step costs from the heartbeats, and on a burst of long prompts switches a decode
worker to prefill through POST /v1/workers/{id}/role; every request is answered meanwhile."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from argparse import Namespace

import openai
import pytest
from cluster_harness import running_cluster
from tiny_models import build_tiny_chat_model

from planner.act import RouterRoleSwitch
from planner.decide import DECODE, PREFILL, Change
from planner.observe import RouterClient
from planner.service import build_planner

# A prompt token costs a millisecond: a 600-token prompt is ~0.6 s of a prefill worker.
COST = {"fixed_s": 0.005, "per_token_s": 0.001, "per_seq_s": 0.0005, "kv_tokens": 16384}


def planner_args(cost_path, **overrides) -> Namespace:
    values = {
        "slo_ttft_ms": 1500.0,
        "slo_itl_ms": 200.0,
        "planner_interval": 1.0,
        "planner_window": 8.0,
        "min_prefill": 1,
        "min_decode": 1,
        "planner_margin": 0.03,
        "cost_model": str(cost_path),
        "role_switch": True,
    }
    return Namespace(**{**values, **overrides})


def workers(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    cost = tmp_path_factory.mktemp("cost") / "cost.json"
    cost.write_text(json.dumps(COST))
    log = tmp_path_factory.mktemp("logs") / "up.log"
    flags = ("--prefill", "1", "--decode", "3", "--remote-prefill-min-tokens", "1")
    flags += ("--simulated-engine", str(cost), "--max-model-len", "1024")
    with running_cluster(folder, log, *flags) as base:
        yield base, folder, cost


def test_a_burst_of_long_prompts_gets_a_decode_worker_switched_to_prefill(cluster):
    base, folder, cost = cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    planner = build_planner(planner_args(cost), RouterClient(base))
    assert isinstance(planner.switcher, RouterRoleSwitch) and planner.scaler is None
    quiet = planner.step()
    assert quiet.change is None, quiet.reason
    answers: list[object] = []

    def ask(index: int) -> None:
        prompt = [(i * 7 + index) % 3000 + 10 for i in range(600)]
        result = client.completions.create(
            model=folder.name, prompt=prompt, max_tokens=3, temperature=0.0
        )
        answers.append(result.choices[0].finish_reason)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(14)]
    for thread in threads:
        thread.start()
        time.sleep(0.15)
    # The burst's arrivals are in the window now: prefill is short of workers.
    decision = planner.step()
    assert decision.change == Change("switch", PREFILL), decision.reason
    assert planner.changes and "switching" in planner.changes[-1].what
    # While the switch is in flight it is counted: no second one at once.
    follow = planner.step()
    assert follow.change is None or follow.change.role == PREFILL
    for thread in threads:
        thread.join(timeout=120)
    assert answers == ["length"] * 14
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listing = workers(base)
        if len(listing[PREFILL]) >= 2 and not any(w["switching"] for w in listing[DECODE]):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no decode worker became a prefill worker: {listing}")
    # Its step figures reached the fits: the prefill pool's per-token cost is near the model's.
    cost_now = planner.observer.fitters[PREFILL].cost()
    assert planner.observer.fitters[PREFILL].samples
    assert 0.0005 < cost_now.per_token_s < 0.003
