"""The planner's Prometheus metrics (docs/metrics.md, "The planner"), on its own registry,
served at ``--metrics-port``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

ROLES = ("prefill", "decode")


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "pdserve_planner_decisions",
            "The planner's decisions, one an interval, by action (hold, switch, add, remove)",
            ["action"],
            registry=r,
        )
        self.failed = Counter(
            "pdserve_planner_changes_failed",
            "Changes an actuator could not start (a switch refused, a scale call failed)",
            registry=r,
        )
        self.workers = Gauge(
            "pdserve_planner_workers",
            "Workers of each role as the planner counts them: registered, with the changes in "
            "flight landed",
            ["role"],
            registry=r,
        )
        self.target = Gauge(
            "pdserve_planner_target_workers",
            "The split the planner moves towards, by role",
            ["role"],
            registry=r,
        )
        self.predicted = Gauge(
            "pdserve_planner_predicted_attainment",
            "Predicted share of requests meeting both SLOs, for the current split and the target",
            ["split"],
            registry=r,
        )
        self.observed = Gauge(
            "pdserve_planner_observed_attainment",
            "Share of the window's finished sequences that met both SLOs",
            registry=r,
        )
        self.arrival_rate = Gauge(
            "pdserve_planner_arrival_rate",
            "Requests arriving per second over the planner's window",
            registry=r,
        )
        self.step_cost = Gauge(
            "pdserve_planner_step_cost_seconds",
            "Each pool's fitted step cost: its fixed part, per token and per row",
            ["role", "term"],
            registry=r,
        )
        self.predicted_latency = Gauge(
            "pdserve_planner_predicted_latency_seconds",
            "Predicted mean TTFT and ITL of the current split",
            ["kind"],
            registry=r,
        )
        for action in ("hold", "switch", "add", "remove"):
            self.decisions.labels(action)
