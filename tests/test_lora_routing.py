"""Routing by which LoRA adapters each worker holds (router/policy.py), as a pure function: a
request under an adapter prefers the worker with it in a device slot, then in host memory,
beside prefix hits and load; the base model's requests are routed as before."""

from __future__ import annotations

from common.hashing import page_hashes
from router.policy import (
    REASON_LOAD,
    REASON_PREFIX,
    AdaptersHeld,
    DecodeView,
    PrefillView,
    RequestView,
    RoutingConfig,
    WorkersView,
    route,
)

PAGE = 16
CONFIG = RoutingConfig(remote_prefill_min_tokens=64)
PROMPT = list(range(512))
NAMESPACE = "lora:sql:0123"
HASHES = page_hashes(PROMPT, PAGE, namespace=NAMESPACE)
ON_DEVICE = AdaptersHeld(on_device=frozenset({"sql"}), on_host=frozenset({"sql"}))
ON_HOST = AdaptersHeld(on_host=frozenset({"sql"}))
DECODE = [DecodeView("d0", free_pages=1000, num_running=0)]


def request(lora_name: str | None = "sql") -> RequestView:
    return RequestView(len(PROMPT), HASHES, PAGE, 16, lora_name=lora_name)


def prefill(worker_id: str, adapters: AdaptersHeld, load: int = 0, cached: int = 0) -> PrefillView:
    return PrefillView(worker_id, load, 0, frozenset(HASHES[:cached]), adapters)


def test_the_worker_holding_the_adapter_in_a_slot_wins_then_the_one_holding_it_in_memory():
    workers = [prefill("p0", AdaptersHeld()), prefill("p1", ON_HOST), prefill("p2", ON_DEVICE)]
    decision = route(request(), WorkersView(workers, DECODE), CONFIG)
    assert (decision.prefill_worker_id, decision.reason) == ("p2", REASON_LOAD)
    decision = route(request(), WorkersView(workers[:2], DECODE), CONFIG)
    assert decision.prefill_worker_id == "p1"


def test_residency_is_weighed_beside_load_and_prefix_hits():
    # A cold worker with much less queued still wins: a miss costs lora_miss_tokens.
    workers = [prefill("p0", ON_DEVICE, load=1000), prefill("p1", AdaptersHeld(), load=0)]
    assert route(request(), WorkersView(workers, DECODE), CONFIG).prefill_worker_id == "p1"
    workers = [prefill("p0", ON_DEVICE, load=100), prefill("p1", AdaptersHeld(), load=0)]
    assert route(request(), WorkersView(workers, DECODE), CONFIG).prefill_worker_id == "p0"
    # Pages cached under the adapter outweigh a slot elsewhere.
    workers = [prefill("p0", ON_DEVICE), prefill("p1", AdaptersHeld(), cached=24)]
    decision = route(request(), WorkersView(workers, DECODE), CONFIG)
    assert (decision.prefill_worker_id, decision.reason) == ("p1", REASON_PREFIX)


def test_the_decode_worker_holding_the_adapter_wins_and_the_base_model_ignores_adapters():
    decode = [
        DecodeView("d0", free_pages=1000, num_running=0),
        DecodeView("d1", free_pages=990, num_running=0, adapters=ON_DEVICE),
    ]
    workers = [prefill("p0", AdaptersHeld()), prefill("p1", ON_DEVICE)]
    decision = route(request(), WorkersView(workers, decode), CONFIG)
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p1", "d1")
    base = route(request(lora_name=None), WorkersView(workers, decode), CONFIG)
    assert (base.prefill_worker_id, base.decode_worker_id) == ("p0", "d0")
