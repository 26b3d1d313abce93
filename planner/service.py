"""``pdserve planner``: every interval, observe the router, fit each pool's step cost, decide,
and act through the actuators; each decision logged with its reason and exported as metrics.

    pdserve planner --router http://127.0.0.1:8000 --slo-ttft-ms 2000 --slo-itl-ms 100

Acts by role switches through the router (always), and by starting or stopping workers where
an actuator can (``--actuator kubernetes``; ``pdserve up --planner`` lends it its own).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace

from prometheus_client import start_http_server

from common.cost_model import CostModel
from planner.act import ActuationError, Actuator, KubernetesScale, RouterRoleSwitch
from planner.decide import DECODE, PREFILL, Change, Decision, History, PlannerConfig, decide
from planner.fit import StepCost, StepCostFitter
from planner.metrics import PlannerMetrics
from planner.observe import Observer, RouterClient, RouterUnreachable
from planner.predict import PoolShape

logger = logging.getLogger("pdserve.planner")

# The prior of a pool's step cost before its steps are seen: a CPU's, roughly (the fit moves
# off it as soon as steps of two sizes are seen).
DEFAULT_PRIOR = StepCost(fixed_s=0.01, per_token_s=0.001, per_seq_s=0.001)


@dataclass(slots=True)
class LoggedChange:
    interval: int
    change: Change
    what: str
    at: float  # time.monotonic()


@dataclass(slots=True)
class Planner:
    """One planner: call ``step`` once an interval (``run`` does)."""

    observer: Observer
    config: PlannerConfig
    switcher: Actuator | None
    scaler: Actuator | None = None
    metrics: PlannerMetrics = field(default_factory=PlannerMetrics)
    history: History = field(default_factory=History)
    changes: list[LoggedChange] = field(default_factory=list)  # those the actuators started
    last: Decision | None = None

    def step(self) -> Decision:
        try:
            seen = self.observer.observe()
        except RouterUnreachable as exc:
            decision = Decision(None, f"hold: cannot observe the router: {exc}", None, None)
            self._record(decision)
            return decision
        pending = {PREFILL: 0, DECODE: 0}
        if self.scaler is not None:
            pending = self.scaler.pending(seen)
        prefill = seen.count(PREFILL) + pending[PREFILL]
        decode = seen.count(DECODE) + pending[DECODE]
        in_flight = seen.switching + sum(abs(n) for n in pending.values())
        costs = {role: self.observer.fitters[role].cost() for role in (PREFILL, DECODE)}
        decision = decide(
            prefill,
            decode,
            in_flight,
            seen.traffic,
            costs[PREFILL],
            costs[DECODE],
            self.config,
            self.history,
        )
        change = decision.change
        if change is not None:
            actuator = self.switcher if change.action == "switch" else self.scaler
            try:
                if actuator is None:
                    raise ActuationError(f"no actuator can {change.action}")
                what = actuator.apply(change, seen)
                self.changes.append(
                    LoggedChange(self.history.interval, change, what, time.monotonic())
                )
                logger.info("planner: %s (%s)", decision.reason, what)
            except ActuationError as exc:
                self.metrics.failed.inc()
                logger.warning("planner: %s failed: %s", decision.reason, exc)
                decision = replace(
                    decision, change=None, reason=f"{decision.reason}; failed: {exc}"
                )
        else:
            logger.info("planner: %s", decision.reason)
        self._record(decision)
        m = self.metrics
        m.workers.labels(PREFILL).set(prefill)
        m.workers.labels(DECODE).set(decode)
        m.arrival_rate.set(seen.traffic.rate)
        attained = seen.attained(self.config.slo_ttft_s, self.config.slo_itl_s)
        if attained is not None:
            m.observed.set(attained)
        for role, cost in costs.items():
            m.step_cost.labels(role, "fixed").set(cost.fixed_s)
            m.step_cost.labels(role, "per_token").set(cost.per_token_s)
            m.step_cost.labels(role, "per_seq").set(cost.per_seq_s)
        return decision

    def _record(self, decision: Decision) -> None:
        self.history.record(decision.change)
        self.last = decision
        m = self.metrics
        m.decisions.labels(decision.change.action if decision.change else "hold").inc()
        if decision.current is not None:
            m.predicted.labels("current").set(_finite(decision.current.attainment))
            m.predicted_latency.labels("ttft").set(_finite(decision.current.ttft_s))
            m.predicted_latency.labels("itl").set(_finite(decision.current.itl_s))
        if decision.target is not None:
            m.predicted.labels("target").set(_finite(decision.target.attainment))
            m.target.labels(PREFILL).set(decision.target.prefill)
            m.target.labels(DECODE).set(decision.target.decode)

    def run(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:
                logger.exception("planner: the interval failed")
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -1.0


def add_planner_args(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    """The planner's flags. ``pdserve up`` takes the same but ``--router`` and ``--api-key``
    (its own) and ``--slo-ttft-ms`` (its own, which the router's goodput shares)."""
    group = parser.add_argument_group("planner")
    if standalone:
        group.add_argument("--router", required=True, help="the router's URL, http://HOST:PORT")
        group.add_argument("--api-key", default=None, help="the router's API key, if it has one")
        group.add_argument("--slo-ttft-ms", type=float, default=None, help="the TTFT objective")
    group.add_argument(
        "--slo-itl-ms", type=float, default=None, help="the inter-token latency objective"
    )
    group.add_argument(
        "--planner-interval", type=float, default=10.0, help="seconds between decisions"
    )
    group.add_argument(
        "--planner-window", type=float, default=30.0, help="seconds of traffic each decision sees"
    )
    group.add_argument("--min-prefill", type=int, default=1, help="the fewest prefill workers")
    group.add_argument("--min-decode", type=int, default=1, help="the fewest decode workers")
    group.add_argument(
        "--planner-margin",
        type=float,
        default=0.03,
        help="the predicted gain in attainment a change needs (hysteresis)",
    )
    group.add_argument(
        "--planner-max-pending",
        type=int,
        default=1,
        help="changes in flight (switches draining, workers starting) before the next waits",
    )
    group.add_argument(
        "--cost-model",
        default=None,
        metavar="COST_MODEL.json",
        help="the step cost the fit starts from, for both pools (benchmarks/cost_models/)",
    )
    group.add_argument(
        "--no-role-switch",
        dest="role_switch",
        action="store_false",
        help="never switch a worker's role; only start and stop workers",
    )


def planner_config(args: argparse.Namespace, can_scale: bool, max_workers: int | None):
    if args.slo_ttft_ms is None or args.slo_itl_ms is None:
        raise ValueError("the planner needs --slo-ttft-ms and --slo-itl-ms")
    shape = PoolShape()
    context_cost = 0.0
    if args.cost_model:
        model = CostModel.load(args.cost_model)
        shape = PoolShape(
            token_budget=model.max_num_batched_tokens or shape.token_budget,
            kv_tokens=model.kv_tokens,
        )
        context_cost = model.per_context_token_s
    return PlannerConfig(
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_itl_s=args.slo_itl_ms / 1e3,
        min_prefill=args.min_prefill,
        min_decode=args.min_decode,
        max_workers=max_workers,
        can_switch=args.role_switch,
        can_scale=can_scale,
        margin=args.planner_margin,
        max_pending=args.planner_max_pending,
        prefill_shape=shape,
        decode_shape=shape,
        decode_context_cost_s=context_cost,
    )


def prior(args: argparse.Namespace) -> StepCost:
    if not args.cost_model:
        return DEFAULT_PRIOR
    model = CostModel.load(args.cost_model)
    return StepCost(model.fixed_s, model.per_token_s, model.per_seq_s)


def build_planner(
    args: argparse.Namespace,
    client: RouterClient,
    scaler: Actuator | None = None,
    max_workers: int | None = None,
) -> Planner:
    config = planner_config(args, scaler is not None, max_workers)
    start = prior(args)
    fitters = {PREFILL: StepCostFitter(start), DECODE: StepCostFitter(start)}
    observer = Observer(client, fitters, args.planner_window)
    switcher = RouterRoleSwitch(client) if args.role_switch else None
    return Planner(observer, config, switcher, scaler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve planner",
        description="Set the prefill:decode split to meet the SLOs: role switches, and workers "
        "started or stopped through an actuator.",
    )
    add_planner_args(parser)
    parser.add_argument(
        "--actuator",
        choices=["none", "kubernetes"],
        default="none",
        help="what starts and stops workers (none: role switches alone; kubernetes: the "
        "floors of the pools' autoscalers)",
    )
    parser.add_argument(
        "--max-workers", type=int, default=None, help="the most workers the actuator may run"
    )
    parser.add_argument("--kubernetes-api", default=None, help="default: the Pod's API server")
    parser.add_argument("--kubernetes-namespace", default=None, help="default: the Pod's")
    parser.add_argument(
        "--prefill-autoscaler",
        default="pdserve-prefill",
        help="the prefill pool's HorizontalPodAutoscaler, whose floor the planner sets",
    )
    parser.add_argument("--decode-autoscaler", default="pdserve-decode")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    client = RouterClient(args.router, args.api_key)
    scaler: Actuator | None = None
    try:
        if args.actuator == "kubernetes":
            scaler = KubernetesScale(
                args.kubernetes_api,
                args.kubernetes_namespace,
                {PREFILL: args.prefill_autoscaler, DECODE: args.decode_autoscaler},
            )
            if args.max_workers is None:
                raise ValueError("--actuator kubernetes needs --max-workers")
        planner = build_planner(args, client, scaler, args.max_workers)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, registry=planner.metrics.registry)
    stop = threading.Event()
    with contextlib.suppress(KeyboardInterrupt):
        planner.run(args.planner_interval, stop)
    return 0
