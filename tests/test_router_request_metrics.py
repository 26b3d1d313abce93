"""The router's request metrics, driven through the dispatcher without sockets: the TTFT split
from the workers' stage times, inter-token and per-output-token latencies, finish reasons, and
SLO goodput."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_router_registry import beat, reg

from common.protocol import StageTimes, TokenDelta, TokenSample
from common.sampling_params import SamplingParams
from router.dispatcher import Dispatcher, Generation
from router.metrics import RouterMetrics
from router.policy import RoutingConfig
from router.registry import WorkerRegistry
from router.request_metrics import ServiceLevel


@pytest.fixture
def cluster():
    """A dispatcher over one prefill and one decode worker, with a 1 s TTFT and 100 ms TPOT
    objective; messages it sends go nowhere."""
    registry = WorkerRegistry("m", heartbeat_timeout=30)
    for worker_id, role in (("p", "prefill"), ("d", "decode")):
        assert registry.register(reg(worker_id, role), time.monotonic()) is None
        registry.on_heartbeat(beat(worker_id), time.monotonic())
    metrics = RouterMetrics(ServiceLevel(ttft_s=1.0, tpot_s=0.1))
    routing = RoutingConfig(remote_prefill_min_tokens=0)
    return Dispatcher(registry, routing, metrics, lambda *_: None, 3, 1.0), metrics


def submit(dispatcher: Dispatcher, name: str, arrived_at: float) -> Generation:
    gen = Generation(
        name, list(range(40)), SamplingParams(max_tokens=8), asyncio.Queue(), 0,
        arrived_at=arrived_at,
    )  # fmt: skip
    dispatcher.submit([gen])
    assert (gen.prefill_worker, gen.decode_worker) == ("p", "d")
    return gen


def delta(gen: Generation, start: int, count: int, **fields) -> TokenDelta:
    samples = [TokenSample(7) for _ in range(count)]
    return TokenDelta(gen.wire_id, samples, start_index=start, num_prompt_tokens=40, **fields)


def value(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_stage_times_latencies_and_goodput(cluster):
    dispatcher, metrics = cluster
    t0 = time.monotonic()
    slow = submit(dispatcher, "slow", t0)
    dispatched = slow.dispatched_at
    first = StageTimes(queue_s=0.1, prefill_s=0.2)
    handed_off = StageTimes(handoff_s=0.05, decode_queue_s=0.01)
    first_token = delta(slow, 0, 1, first=True, num_cached_tokens=16, timings=first)
    dispatcher.on_message("p", first_token, t0 + 0.5)
    dispatcher.on_message("d", delta(slow, 1, 1, timings=handed_off), t0 + 0.6)
    dispatcher.on_message("d", delta(slow, 2, 1, finish_reason="length"), t0 + 0.8)

    assert value(metrics, "pdserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    router_queue = dispatched - t0
    assert value(metrics, "pdserve_request_router_queue_time_seconds_sum") == router_queue
    assert value(metrics, "pdserve_request_queue_time_seconds_sum") == pytest.approx(
        router_queue + 0.1
    )
    hop = value(metrics, "pdserve_request_first_token_hop_seconds_sum")
    assert router_queue + 0.1 + 0.2 + hop == pytest.approx(0.5)
    assert value(metrics, "pdserve_request_handoff_wait_seconds_sum") == 0.05
    assert value(metrics, "pdserve_request_decode_queue_time_seconds_sum") == 0.01
    # Two gaps between three tokens: 0.1 s and 0.2 s.
    assert value(metrics, "pdserve_inter_token_latency_seconds_count") == 2
    assert value(metrics, "pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(metrics, "pdserve_request_time_per_output_token_seconds_sum") == pytest.approx(
        0.15
    )
    assert value(metrics, "pdserve_e2e_request_latency_seconds_sum") == pytest.approx(0.8)
    assert value(metrics, "pdserve_request_inference_time_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "pdserve_prompt_tokens_total") == 40
    assert value(metrics, "pdserve_prompt_tokens_cached_total") == 16
    assert value(metrics, "pdserve_generation_tokens_total") == 3
    assert value(metrics, "pdserve_request_success_total", finished_reason="length") == 1
    assert value(metrics, "pdserve_request_goodput_total") == 0  # TPOT 150 ms > 100 ms

    fast = submit(dispatcher, "fast", t0)
    dispatcher.on_message("p", delta(fast, 0, 1, first=True, timings=first), t0 + 0.5)
    dispatcher.on_message("d", delta(fast, 1, 4, finish_reason="stop"), t0 + 0.7)  # 4 at once
    assert value(metrics, "pdserve_request_goodput_total") == 1  # TPOT 50 ms
    assert value(metrics, "pdserve_request_success_total", finished_reason="stop") == 1

    late = submit(dispatcher, "late", t0)
    dispatcher.on_message("p", delta(late, 0, 1, first=True, timings=first), t0 + 1.5)
    dispatcher.on_message("d", delta(late, 1, 1, finish_reason="stop"), t0 + 1.52)
    assert value(metrics, "pdserve_request_goodput_total") == 1  # TTFT 1.5 s > 1 s
    assert value(metrics, "pdserve_slo_ttft_seconds") == 1.0
    assert value(metrics, "pdserve_slo_tpot_seconds") == 0.1


def test_sequences_the_router_ends_count_by_reason_without_latencies(cluster):
    dispatcher, metrics = cluster
    t0 = time.monotonic()
    stopped, left = submit(dispatcher, "stopped", t0), submit(dispatcher, "left", t0)
    for gen in (stopped, left):
        dispatcher.on_message("p", delta(gen, 0, 1, first=True), t0 + 0.1)
    dispatcher.finish_early(stopped, "stop_string")
    dispatcher.finish_early(left, "client_disconnected")
    dispatcher.finish_early(left, "done")  # already ended: counted once
    assert value(metrics, "pdserve_request_success_total", finished_reason="stop") == 1
    assert value(metrics, "pdserve_request_success_total", finished_reason="abort") == 1
    # A stop string is a finish: its latencies count; an abort's do not.
    assert value(metrics, "pdserve_e2e_request_latency_seconds_count") == 1
    assert value(metrics, "pdserve_request_goodput_total") == 1


def test_no_objective_means_every_finished_sequence_is_goodput():
    assert ServiceLevel().met(ttft_s=1e9, tpot_s=1e9)
    assert not ServiceLevel(tpot_s=0.05).met(ttft_s=0.0, tpot_s=0.051)
    assert "pdserve_slo_ttft_seconds" not in str(
        [m.name for m in RouterMetrics().registry.collect()]
    )
