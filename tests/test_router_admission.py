"""Admission (router/admission.py): the queue's order, the predicted wait, and through the
router's HTTP edge, a request refused at once with a 429 and Retry-After, requests waiting for a
worker with room served lowest priority first, and one that leaves the queue when its client
goes."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from router_fakes import model_text, router_server, start_fakes, wait_until

from common.model.default_model import resolve_model_path
from common.protocol import PrefillRequest
from router.admission import AdmissionConfig, Overloaded, WaitingQueue, predicted_wait_s
from router.registry import WorkerState

MODEL = resolve_model_path(None)


def worker(role: str, **load) -> WorkerState:
    state = WorkerState(
        worker_id=role, incarnation="x", role=role, model="m", page_size=16, num_pages=100,
        max_model_len=2048, metrics_url="", kv_transfer="zmq", handoff_endpoint=None,
        deterministic=False, registered_at=0.0, last_seen=0.0,
    )  # fmt: skip
    for name, value in load.items():
        setattr(state, name, value)
    return state


def test_the_predicted_wait_adds_each_queue_at_its_measured_pace():
    prefill = worker("prefill", queued_prefill_tokens=3000, prefill_tokens_per_s=1000.0)
    decode = worker("decode", num_waiting=4, finished_per_s=2.0)
    assert predicted_wait_s(prefill, decode, 0, [decode]) == 3.0 + 2.0
    # Waiting here behind 5 (itself the 6th) for a pool that finishes 2 + 1 a second.
    other = worker("decode", finished_per_s=1.0)
    assert predicted_wait_s(prefill, decode, 6, [decode, other]) == 5.0 + 6 / 3.0
    # Prefilled on its decode worker: that worker's own queued prompt tokens count instead.
    local = worker("decode", queued_prefill_tokens=500, prefill_tokens_per_s=250.0)
    assert predicted_wait_s(None, local, 0, [local]) == 2.0
    # Nothing measured yet: no wait predicted, nothing refused on a guess.
    assert predicted_wait_s(worker("prefill", queued_prefill_tokens=10**6), decode, 0, []) == 2.0


def test_overloaded_says_when_to_come_back():
    assert Overloaded(7.2, 5.0).retry_after_s == 3
    assert Overloaded(5.01, 5.0).retry_after_s == 1
    with pytest.raises(ValueError, match="--max-queue-delay"):
        AdmissionConfig(max_queue_delay_s=0)
    with pytest.raises(ValueError, match="--max-inflight-per-worker"):
        AdmissionConfig(max_inflight_per_worker=0)


def test_the_queue_serves_lowest_priority_then_oldest_and_gives_up_whole_groups():
    queue = WaitingQueue()
    groups = {name: [object(), object()] for name in "abcd"}
    for name, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1)):
        queue.push(groups[name], priority)
    assert queue.ahead_of(0) == 2 and queue.ahead_of(5) == 4 and queue.ahead_of(-5) == 0
    assert queue.remove(groups["c"][1]) is groups["c"]
    assert queue.remove(object()) is None
    assert [queue.pop() for _ in range(len(queue))] == [groups["d"], groups["b"], groups["a"]]


SEEDS = {"first": 0, "later": 1, "urgent": 2, "middle": 3}  # four different prompts


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0)


def prompt(seed: int) -> str:
    return " ".join(["alpha", "beta", "gamma", "delta"][(seed + i) % 4] for i in range(100))


@pytest.mark.slow
def test_a_request_predicted_to_wait_too_long_is_refused_at_once_with_retry_after():
    admission = AdmissionConfig(max_queue_delay_s=5.0)
    with router_server(MODEL, admission=admission) as router:
        p0, _ = start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        p0.hold_prefills.set()
        body = {"model": MODEL.name, "prompt": prompt(0), "max_tokens": 2}
        with httpx.Client(base_url=router.base_url, timeout=60) as h:
            accepted = [
                threading.Thread(target=h.post, args=("/v1/completions",), kwargs={"json": body})
                for _ in range(8)
            ]
            for thread in accepted:
                thread.start()
            wait_until(lambda: len(p0.held) == 8)
            # Now it measures its pace: 100 prompt tokens a second, over a second per prompt.
            p0.prefill_tokens_per_s = 100.0
            p0_state = router.app.state.registry.workers["p0"]
            wait_until(lambda: p0_state.prefill_tokens_per_s == 100.0)
            assert p0_state.load_tokens > 600
            started = time.monotonic()
            refused = h.post("/v1/completions", json=body)
            assert time.monotonic() - started < 2.0  # told at once, not after a timeout
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and "--max-queue-delay" in error["message"]
            assert int(refused.headers["retry-after"]) >= 1
            assert router.metric("pdserve_router_refused_requests_total", reason="queue_delay") == 1
            p0.hold_prefills.clear()
            for thread in accepted:
                thread.join(60)
        assert (
            router.metric("pdserve_router_requests_total", route="/v1/completions", status="200")
            == 8
        )


@pytest.mark.slow
def test_requests_waiting_for_room_are_served_lowest_priority_first():
    admission = AdmissionConfig(max_inflight_per_worker=1)
    with router_server(MODEL, admission=admission) as router:
        p0, _ = start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        p0.hold_prefills.set()
        answers: dict[str, str] = {}

        def ask(name: str, priority: int) -> None:
            out = client(router).completions.create(
                model=MODEL.name, prompt=prompt(SEEDS[name]), max_tokens=2,
                extra_body={"priority": priority},
            )  # fmt: skip
            answers[name] = out.choices[0].finish_reason

        threads = {"first": threading.Thread(target=ask, args=("first", 0))}
        threads["first"].start()
        wait_until(lambda: len(p0.held) == 1)
        waiting = router.app.state.dispatcher.waiting
        for queued, (name, priority) in enumerate((("later", 5), ("urgent", -3), ("middle", 0))):
            threads[name] = threading.Thread(target=ask, args=(name, priority))
            threads[name].start()
            wait_until(lambda queued=queued: len(waiting) == queued + 1)
        assert router.metric("pdserve_router_queued_requests") == 3
        p0.hold_prefills.clear()
        for thread in threads.values():
            thread.join(60)
        assert answers == dict.fromkeys(threads, "length")
        order = [m.prompt_token_ids for m in p0.received if isinstance(m, PrefillRequest)]
        codec = model_text(MODEL)
        served = ("first", "urgent", "middle", "later")
        assert order == [codec.encode(prompt(SEEDS[name])) for name in served]


@pytest.mark.slow
def test_a_request_whose_client_goes_while_it_waits_leaves_the_queue():
    admission = AdmissionConfig(max_inflight_per_worker=1)
    with router_server(MODEL, admission=admission) as router:
        p0, _ = start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        p0.hold_prefills.set()
        body = {"model": MODEL.name, "prompt": prompt(1), "max_tokens": 2}
        with httpx.Client(base_url=router.base_url, timeout=60) as h:
            first = threading.Thread(
                target=h.post, args=("/v1/completions",), kwargs={"json": body}
            )
            first.start()
            wait_until(lambda: len(p0.held) == 1)
            impatient = httpx.Client(base_url=router.base_url, timeout=0.5)
            with impatient, pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/completions", json={**body, "prompt": prompt(2)})
            wait_until(lambda: len(router.app.state.dispatcher.waiting) == 0)
            assert router.metric("pdserve_router_aborts_total", cause="client_disconnected") == 1
            p0.hold_prefills.clear()
            first.join(60)
        assert len([m for m in p0.received if isinstance(m, PrefillRequest)]) == 1


def test_a_request_larger_than_the_router_ever_holds_is_a_400_not_a_429():
    """Retrying could never help: more sequences than --max-inflight in one request."""
    with router_server(MODEL, max_inflight=4) as router:
        start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        with router.client() as h:
            body = {"model": MODEL.name, "prompt": ["a", "b", "c"], "n": 2, "temperature": 1.0}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "n" and "--max-inflight" in r.text
            r = h.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
            assert r.status_code == 200, r.text
