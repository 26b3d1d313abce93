"""A cluster of simulated workers (one prefill, three decode): they serve through router ->
prefill -> decode on the real wire, the router shows a planner its traffic and the workers' step
figures; the planner observes it over HTTP, fits the pools' step costs from the heartbeats, and
on a burst of long prompts switches a decode worker to prefill through POST
/v1/workers/{id}/role, every request answered meanwhile; and `pdserve up`'s launcher starts and
stops a worker for the planner's local actuator."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from argparse import Namespace

import openai
import pytest
from cluster_harness import running_cluster
from tiny_models import build_tiny_chat_model

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.simulated import SimulatedRunner
from pdserve import launcher
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
        "planner_max_pending": 1,
    }
    return Namespace(**{**values, **overrides})


def workers(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    cost = tmp_path_factory.mktemp("cost") / "cost.json"
    cost.write_text(json.dumps(COST))
    logs = tmp_path_factory.mktemp("logs")
    secret = logs / "cluster-secret"
    secret.write_text("a-test-secret-of-32-characters-x\n")
    flags = ("--prefill", "1", "--decode", "3", "--remote-prefill-min-tokens", "1")
    flags += ("--simulated-engine", str(cost), "--max-model-len", "1024")
    flags += ("--cluster-secret-file", str(secret))
    with running_cluster(folder, logs / "up.log", *flags) as base:
        yield base, folder, cost, secret


def expected_tokens(runner: SimulatedRunner, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(runner.token_after(tokens))
    return tokens[len(prompt) :]


def test_simulated_workers_serve_through_prefill_and_decode(cluster):
    base, folder, cost, _ = cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    engine = LLMEngine(EngineConfig(model=str(folder), simulated_engine=str(cost)))
    runner = engine.runner
    assert isinstance(runner, SimulatedRunner)
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
        # Every worker gives a request the same tokens as the one-process simulated engine.
        assert choice.token_ids == expected_tokens(runner, prompt, 12)
        assert choice.finish_reason == "length"
    # The prompts went through the prefill worker, whose pages went to decode over the wire.
    listing = workers(base)
    assert len(listing["prefill"]) == 1 and len(listing["decode"]) == 3
    text = urllib.request.urlopen(listing["prefill"][0]["metrics_url"], timeout=10).read()
    match = re.search(rb"^pdserve_prompt_tokens_computed_total (\S+)$", text, re.MULTILINE)
    assert match and float(match.group(1)) >= 40 + 200 + 300 - 3 * 16  # less a cached page each


def test_the_router_shows_the_planner_its_traffic_and_step_figures(cluster):
    base, folder, _, _ = cluster
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
        listing = workers(base)
        everyone = listing["prefill"] + listing["decode"]
        stepped = [w["steps"] for w in everyone if w["steps"]["count"]]
        if stepped and all(s["busy_seconds"] > 0 and s["tokens"] >= s["rows"] > 0 for s in stepped):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no step figures in {listing}")


def test_a_burst_of_long_prompts_gets_a_decode_worker_switched_to_prefill(cluster):
    base, folder, cost, _ = cluster
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


def test_the_launcher_starts_and_stops_workers_for_the_planner(cluster):
    """The local actuator's launcher (`pdserve up --planner --max-workers N`): a worker started
    with the cluster's flags registers with the router; one stopped drains and leaves."""
    base, folder, cost, secret = cluster
    args, _ = launcher.build_parser().parse_known_args([])
    control = "tcp://127.0.0.1:" + str(int(base.rsplit(":", 1)[1]) + 1)
    shared = ["--router", control, "--model", str(folder), "--host", "127.0.0.1"]
    shared += ["--cluster-secret-file", str(secret), "--log-level", "WARNING"]
    services: list[launcher.Service] = []
    local = launcher.LocalLauncher(
        services,
        threading.Lock(),
        shared,
        ["--simulated-engine", str(cost), "--max-model-len", "1024"],
        args,
        first_index=20,
    )
    worker_id = local.start(DECODE)
    assert worker_id == "decode-20" and len(services) == 1
    try:
        deadline = time.monotonic() + 120
        while worker_id not in {w["id"] for w in workers(base)[DECODE]}:
            assert services[0].process.poll() is None, "the started worker exited"
            assert time.monotonic() < deadline, "the started worker never registered"
            time.sleep(0.2)
        process = services[0].process
        local.stop(worker_id)
        assert services == []  # no longer the supervisor's to restart
        assert process.wait(timeout=60) == 0  # drained and left
        deadline = time.monotonic() + 30
        while worker_id in {w["id"] for w in workers(base)[DECODE]}:
            assert time.monotonic() < deadline, "the stopped worker is still listed"
            time.sleep(0.2)
        with pytest.raises(ValueError):
            local.stop("decode-99")
    finally:
        for service in services:
            service.process.kill()
