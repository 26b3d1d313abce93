"""The planner's decision: which prefill:decode split to move towards, and the one change this
interval makes towards it (or none, and why).

A pure function of what was observed (``decide``): the split as it will be once pending changes
land, the traffic, the pools' fitted step costs, the SLOs and the bounds. Guards:

- hysteresis: a change only for a predicted gain of at least ``margin`` in attainment;
- at most one change per interval, and none while ``max_pending`` are still in flight;
- no reversal of a change made in the last ``cooldown_intervals`` intervals (a flap);
- scale down only when the survivors still fit: the split with one worker fewer predicts no
  worse attainment and leaves both pools at most ``headroom`` busy;
- in an overload (no split meets the SLOs), the split whose busier pool is least busy, for a
  relief of at least 15% of that pool's utilization;
- targets bounded by the pools' minimums and ``max_workers``; a count below zero or a NaN
  anywhere in the inputs is refused (the decision holds and says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.fit import StepCost
from planner.predict import PoolShape, Prediction, Traffic, predict

PREFILL = "prefill"
DECODE = "decode"

# Attainments this close are equal: the tie goes to fewer workers, then to the nearer split.
_TIE = 0.005
# In an overload, a change must bring the bottleneck's utilization below this share of today's.
_OVERLOAD_RELIEF = 0.85


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    slo_ttft_s: float
    slo_itl_s: float
    min_prefill: int = 1
    min_decode: int = 1
    max_workers: int | None = None  # None: the workers there are now, never more
    can_switch: bool = True  # role switches within the running workers
    can_scale: bool = False  # an actuator that starts and stops workers
    margin: float = 0.03
    headroom: float = 0.8
    cooldown_intervals: int = 2
    max_pending: int = 1
    prefill_shape: PoolShape = field(default_factory=PoolShape)
    decode_shape: PoolShape = field(default_factory=PoolShape)
    decode_context_cost_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_itl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.min_prefill < 0 or self.min_decode < 1:
            raise ValueError("the pools' minimums must be >= 0 (prefill) and >= 1 (decode)")
        if self.max_workers is not None and self.max_workers < self.min_prefill + self.min_decode:
            raise ValueError(
                f"max_workers {self.max_workers} is below the pools' minimums "
                f"{self.min_prefill} + {self.min_decode}"
            )
        if not 0 <= self.margin < 1 or not 0 < self.headroom <= 1:
            raise ValueError("margin must be in [0, 1) and headroom in (0, 1]")
        if self.cooldown_intervals < 0 or self.max_pending < 1:
            raise ValueError("cooldown_intervals must be >= 0 and max_pending >= 1")


@dataclass(frozen=True, slots=True)
class Change:
    """One change: ``switch`` a worker to ``role``, ``add`` a worker of ``role``, or ``remove``
    one of ``role``."""

    action: str  # switch | add | remove
    role: str

    @property
    def delta(self) -> tuple[int, int]:
        """What it does to (prefill, decode)."""
        sign = {"add": 1, "remove": -1}.get(self.action)
        if sign is None:  # a switch
            return (1, -1) if self.role == PREFILL else (-1, 1)
        return (sign, 0) if self.role == PREFILL else (0, sign)

    def reverses(self, other: Change) -> bool:
        a, b = self.delta, other.delta
        return a[0] * b[0] + a[1] * b[1] < 0


@dataclass(frozen=True, slots=True)
class Decision:
    change: Change | None
    reason: str
    current: Prediction | None
    target: Prediction | None


@dataclass(slots=True)
class History:
    """The changes made, by interval: what the flap guard looks back on."""

    interval: int = 0
    changes: list[tuple[int, Change]] = field(default_factory=list)

    def record(self, change: Change | None) -> None:
        if change is not None:
            self.changes.append((self.interval, change))
            del self.changes[:-64]
        self.interval += 1

    def recent(self, intervals: int) -> list[Change]:
        return [c for at, c in self.changes if self.interval - at <= intervals]


def count_flaps(changes: list[tuple[int, Change]], intervals: int = 2) -> int:
    """Changes that reverse one made at most ``intervals`` intervals before."""
    flaps = 0
    for index, (at, change) in enumerate(changes):
        if any(
            at - before <= intervals and change.reverses(earlier)
            for before, earlier in changes[:index]
        ):
            flaps += 1
    return flaps


def decide(
    prefill: int,
    decode: int,
    pending: int,
    traffic: Traffic,
    prefill_cost: StepCost,
    decode_cost: StepCost,
    config: PlannerConfig,
    history: History,
) -> Decision:
    """This interval's decision. ``prefill`` and ``decode``: the workers of each role once the
    ``pending`` changes in flight have landed."""
    problem = _nonsense(prefill, decode, pending, traffic, prefill_cost, decode_cost)
    if problem is not None:
        return Decision(None, f"hold: {problem}", None, None)
    total = prefill + decode
    max_total = config.max_workers if config.can_scale and config.max_workers else total
    max_total = max(max_total, config.min_prefill + config.min_decode)

    def at(p: int, d: int) -> Prediction:
        return predict(
            p,
            d,
            traffic,
            prefill_cost,
            decode_cost,
            config.slo_ttft_s,
            config.slo_itl_s,
            config.prefill_shape,
            config.decode_shape,
            config.decode_context_cost_s,
        )

    # Below the minimums (a pool emptied, nothing registered yet): restore them first.
    if prefill < config.min_prefill or decode < config.min_decode:
        role = PREFILL if prefill < config.min_prefill else DECODE
        if config.can_scale and total < max_total:
            return Decision(Change("add", role), f"add {role}: below its minimum", None, None)
        other_has_spare = (
            decode > config.min_decode if role == PREFILL else prefill > config.min_prefill
        )
        if config.can_switch and other_has_spare:
            return Decision(
                Change("switch", role), f"switch to {role}: below its minimum", None, None
            )
        return Decision(None, f"hold: {role} below its minimum and nothing to move", None, None)
    current = at(prefill, decode)
    if pending >= config.max_pending:
        return Decision(None, f"hold: {pending} change(s) still in flight", current, None)
    totals = range(config.min_prefill + config.min_decode, max_total + 1)
    if not config.can_scale:
        totals = range(total, total + 1)
    candidates = [
        at(p, t - p) for t in totals for p in range(config.min_prefill, t - config.min_decode + 1)
    ]

    def preference(c: Prediction) -> tuple[int, float, int]:
        """Among splits of equal attainment: fewer workers, then the less loaded bottleneck
        (in tenths: what an overload leaves to choose by), then the nearer."""
        distance = abs(c.prefill - prefill) + abs(c.decode - decode)
        return c.prefill + c.decode, round(_bottleneck(c), 1), distance

    best_attainment = max(c.attainment for c in candidates)
    near_best = [c for c in candidates if c.attainment >= best_attainment - _TIE]
    target = min(near_best, key=preference)
    target_total = target.prefill + target.decode
    if target_total < total:
        # Scale down only where the load moved onto the survivors still fits.
        fits = (
            target.attainment >= current.attainment - _TIE
            and target.prefill_utilization <= config.headroom
            and target.decode_utilization <= config.headroom
        )
        if not fits:
            kept = [c for c in candidates if c.prefill + c.decode >= total]
            best_kept = max(c.attainment for c in kept)
            target = min((c for c in kept if c.attainment >= best_kept - _TIE), key=preference)
            target_total = target.prefill + target.decode
    if (target.prefill, target.decode) == (prefill, decode):
        return Decision(None, f"hold: {prefill}:{decode} is the best split", current, target)
    gain = target.attainment - current.attainment
    # Where no split meets the SLOs (an overload), the one whose busiest pool is least busy
    # recovers first: a change for a clear relief of the bottleneck.
    overloaded = best_attainment < config.margin
    relief = _bottleneck(target) < _OVERLOAD_RELIEF * _bottleneck(current)
    if target_total >= total and gain < config.margin and not (overloaded and relief):
        return Decision(
            None,
            f"hold: {target.prefill}:{target.decode} gains {gain:+.1%}, under the margin "
            f"{config.margin:.0%}",
            current,
            target,
        )
    change = _step_towards(prefill, decode, target, config)
    if change is None:
        return Decision(None, "hold: no actuator can make the change", current, target)
    for earlier in history.recent(config.cooldown_intervals):
        if change.reverses(earlier):
            return Decision(
                None,
                f"hold: {change.action} {change.role} would reverse a change of the last "
                f"{config.cooldown_intervals} intervals",
                current,
                target,
            )
    reason = (
        f"{change.action} {change.role}: towards {target.prefill}:{target.decode}, predicted "
        f"attainment {current.attainment:.1%} -> {target.attainment:.1%} "
        f"(TTFT {_ms(current.ttft_s)} -> {_ms(target.ttft_s)}, ITL {_ms(current.itl_s)} -> "
        f"{_ms(target.itl_s)})"
    )
    return Decision(change, reason, current, target)


def _bottleneck(prediction: Prediction) -> float:
    """The busier pool's utilization (past 1: its queue grows without bound)."""
    return max(prediction.prefill_utilization, prediction.decode_utilization)


def _step_towards(
    prefill: int, decode: int, target: Prediction, config: PlannerConfig
) -> Change | None:
    """The one change that moves ``prefill:decode`` towards ``target``: a switch where one
    pool grows as the other shrinks, else an added or removed worker."""
    more_prefill = target.prefill - prefill
    more_decode = target.decode - decode
    if config.can_switch and more_prefill > 0 and more_decode < 0:
        return Change("switch", PREFILL)
    if config.can_switch and more_decode > 0 and more_prefill < 0:
        return Change("switch", DECODE)
    if not config.can_scale:
        return None
    # Growing first where both move: a removal waits until the added worker serves.
    if more_prefill > 0:
        return Change("add", PREFILL)
    if more_decode > 0:
        return Change("add", DECODE)
    if more_prefill < 0:
        return Change("remove", PREFILL)
    if more_decode < 0:
        return Change("remove", DECODE)
    return None


def _nonsense(
    prefill: int,
    decode: int,
    pending: int,
    traffic: Traffic,
    prefill_cost: StepCost,
    decode_cost: StepCost,
) -> str | None:
    if prefill < 0 or decode < 0 or pending < 0:
        return f"negative worker counts ({prefill} prefill, {decode} decode, {pending} pending)"
    if not (math.isfinite(traffic.rate) and traffic.rate >= 0):
        return f"arrival rate {traffic.rate!r}"
    if not (math.isfinite(traffic.output_tokens) and traffic.output_tokens >= 0):
        return f"output length {traffic.output_tokens!r}"
    if any(t < 0 for t in traffic.prompt_tokens):
        return "negative prompt lengths"
    for name, cost in ((PREFILL, prefill_cost), (DECODE, decode_cost)):
        values = (cost.fixed_s, cost.per_token_s, cost.per_seq_s)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            return f"the {name} step cost {cost}"
    return None


def _ms(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds * 1e3:.0f} ms"
