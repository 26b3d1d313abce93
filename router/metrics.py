"""The router's Prometheus metrics, on a registry of its own (one per app; tests run many)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from router.request_metrics import RequestMetrics, ServiceLevel
from router.traffic import TrafficLog

# Fine buckets below a millisecond: the router's own time per request is the figure of merit.
_OVERHEAD_BUCKETS = (
    25e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 400e-6, 500e-6, 750e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0,
)  # fmt: skip


class RouterMetrics:
    def __init__(self, slo: ServiceLevel | None = None) -> None:
        slo = slo or ServiceLevel()
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "pdserve_router_decisions", "Routing decisions by reason", ["reason"], registry=r
        )
        self.requests = Counter(
            "pdserve_router_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.protocol_errors = Counter(
            "pdserve_router_protocol_errors",
            "Control-socket frames dropped as malformed or unexpected",
            registry=r,
        )
        self.registrations = Counter(
            "pdserve_router_registrations",
            "Worker registrations, by outcome",
            ["outcome"],
            registry=r,
        )
        self.workers = Gauge("pdserve_router_workers", "Registered workers", ["role"], registry=r)
        self.removed_workers = Counter(
            "pdserve_router_workers_removed", "Workers taken out, by cause", ["cause"], registry=r
        )
        self.redispatches = Counter(
            "pdserve_router_redispatches",
            "Requests sent again after a worker failed, by kind",
            ["kind"],
            registry=r,
        )
        self.auth_failures = Counter(
            "pdserve_auth_failures",
            "Connections refused on the control socket: the peer did not prove the cluster secret",
            ["socket"],
            registry=r,
        )
        self.stalls = Counter(
            "pdserve_router_stalled_requests",
            "Requests sent again after going --request-stall-timeout seconds without a token",
            registry=r,
        )
        self.aborts = Counter(
            "pdserve_router_aborts",
            "Requests aborted on the workers, by cause",
            ["cause"],
            registry=r,
        )
        self.inflight = Gauge(
            "pdserve_router_inflight_requests", "Sequences being generated", registry=r
        )
        self.structured = Counter(
            "pdserve_router_structured_requests",
            "Requests under a structured output (a JSON schema, a regex, a grammar, a forced "
            "tool call, ...), by kind",
            ["kind"],
            registry=r,
        )
        self.queued = Gauge(
            "pdserve_router_queued_requests",
            "Requests waiting in the router's queue for a worker below --max-inflight-per-worker",
            registry=r,
        )
        self.refusals = Counter(
            "pdserve_router_refused_requests",
            "Requests refused at once with a 429, by reason (queue_delay: predicted to wait "
            "past --max-queue-delay; inflight: past --max-inflight)",
            ["reason"],
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve_router_role_switches",
            "Live worker role switches, by direction (prefill_to_decode, decode_to_prefill) and "
            "outcome (switched; refused by the worker or as the last decode worker; failed: "
            "the worker serves its old role)",
            ["direction", "outcome"],
            registry=r,
        )
        self.role_switch_seconds = Histogram(
            "pdserve_router_role_switch_seconds",
            "Role switches done, from the request to the worker serving its new role (its "
            "drain included), by direction",
            ["direction"],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.overhead = Histogram(
            "pdserve_router_overhead_seconds",
            "The router's own time per request: arrival to dispatch, final token to response",
            ["stage"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        # Request latencies and tokens, vLLM's quantities under pdserve_; SLO goodput.
        self.request = RequestMetrics(r, slo)
        # The same requests' lengths and latencies, one by one, for GET /v1/traffic.
        self.traffic = TrafficLog()
        # ``labels()`` takes a lock and checks its arguments on every call; the label sets are
        # few and fixed, so the hot paths keep each child once it exists.
        self.request_count = _children(self.requests)
        self.decision_count = _children(self.decisions)
        self.abort_count = _children(self.aborts)
        self.overhead_stage = _children(self.overhead)
        self.structured_count = _children(self.structured)


_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


def _children(metric: _Metric) -> Callable[..., _Metric]:
    return lru_cache(maxsize=256)(metric.labels)
