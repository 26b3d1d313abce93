"""The planner's pure parts: the step-cost fit, the prediction of a split, and the decision on
scripted load (scale up on a burst, down only when the survivors fit, no flap on a steady load,
bounded targets on nonsense figures)."""

from __future__ import annotations

import math
import random

import pytest

from planner.decide import (
    DECODE,
    PREFILL,
    Change,
    History,
    PlannerConfig,
    count_flaps,
    decide,
)
from planner.fit import StepCost, StepCostFitter, StepSample
from planner.predict import Traffic, predict

PREFILL_COST = StepCost(fixed_s=0.01, per_token_s=0.001)  # ~1000 prompt tokens/s a worker
DECODE_COST = StepCost(fixed_s=0.02, per_token_s=0.0, per_seq_s=0.001)
SLO = {"slo_ttft_s": 2.0, "slo_itl_s": 0.1}


def traffic(rate: float, prompt: int, output: float) -> Traffic:
    return Traffic(rate, (prompt,) * 20, output)


def run(config: PlannerConfig, split: tuple[int, int], load: Traffic, intervals: int, **kw):
    """Decide ``intervals`` times on ``load``, each change landing at once; returns the final
    split and the history."""
    history = History()
    prefill, decode = split
    for _ in range(intervals):
        decision = decide(prefill, decode, 0, load, PREFILL_COST, DECODE_COST, config, history)
        history.record(decision.change)
        if decision.change is not None:
            dp, dd = decision.change.delta
            prefill, decode = prefill + dp, decode + dd
    return (prefill, decode), history


def test_the_fit_recovers_a_pools_step_cost_and_ignores_nonsense():
    truth = StepCost(0.005, 0.0004, 0.002)
    fitter = StepCostFitter(prior=StepCost(1.0, 1.0, 1.0))
    rng = random.Random(0)
    for _ in range(50):
        tokens, rows = rng.randint(1, 256), rng.randint(1, 16)
        seconds = truth.seconds(tokens, rows) * rng.uniform(0.98, 1.02)
        assert fitter.observe(StepSample(tokens, rows, seconds, steps=rng.randint(1, 5)))
    for bad in (
        StepSample(math.nan, 1, 0.1),
        StepSample(10, 1, -0.1),
        StepSample(10, 0, 0.1),
        StepSample(10, 1, math.inf),
    ):
        assert not fitter.observe(bad)
    cost = fitter.cost()
    assert cost.fixed_s == pytest.approx(truth.fixed_s, abs=0.002)
    assert cost.per_token_s == pytest.approx(truth.per_token_s, rel=0.05)
    assert cost.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.15)


def test_a_feature_that_never_varies_keeps_the_prior_and_no_coefficient_goes_negative():
    prior = StepCost(0.01, 0.001, 0.003)
    fitter = StepCostFitter(prior)
    assert fitter.cost() == prior
    # Decode steps: one token a row, so tokens and rows move together; rows vary, tokens too.
    # A pool whose steps never change size says nothing of the slopes: the prior's stay.
    for _ in range(5):
        fitter.observe(StepSample(8, 8, 0.05))
    cost = fitter.cost()
    assert (cost.per_token_s, cost.per_seq_s) == (prior.per_token_s, prior.per_seq_s)
    assert cost.seconds(8, 8) == pytest.approx(0.05)
    # Times that fall as steps grow would fit a negative slope: it is held at zero.
    falling = StepCostFitter(prior)
    for tokens in (10, 50, 100, 200):
        falling.observe(StepSample(tokens, 1, 0.2 - tokens * 0.0005))
    assert min(falling.cost().per_token_s, falling.cost().fixed_s) >= 0


def test_the_prediction_grows_with_load_and_is_unbounded_past_capacity():
    light = predict(2, 6, traffic(0.5, 500, 50), PREFILL_COST, DECODE_COST, **SLO)
    heavy = predict(2, 6, traffic(3.0, 500, 50), PREFILL_COST, DECODE_COST, **SLO)
    over = predict(2, 6, traffic(10.0, 500, 50), PREFILL_COST, DECODE_COST, **SLO)
    assert light.ttft_s < heavy.ttft_s and light.itl_s < heavy.itl_s
    assert light.attainment > 0.9 > heavy.attainment
    assert over.prefill_utilization > 1 and math.isinf(over.ttft_s) and over.attainment == 0
    # Decode: past what its workers can step in time, the ITL has no bound.
    chat = predict(4, 1, traffic(5.0, 50, 2000), PREFILL_COST, DECODE_COST, **SLO)
    assert math.isinf(chat.itl_s) and chat.attainment == 0


def test_a_burst_of_long_prompts_moves_workers_to_prefill():
    config = PlannerConfig(**SLO)
    # Generation-heavy traffic: a 2:6 split is right and stays.
    steady = traffic(0.6, 300, 150)
    split, history = run(config, (2, 6), steady, 6)
    assert split == (2, 6) and not history.changes
    # Prompts three times the rate, long: prefill is short of workers; one switch an interval.
    burst = traffic(1.8, 1000, 20)
    decision = decide(2, 6, 0, burst, PREFILL_COST, DECODE_COST, config, History())
    assert decision.change == Change("switch", PREFILL)
    assert decision.target is not None and decision.target.prefill > 2
    assert "switch prefill" in decision.reason and "attainment" in decision.reason
    split, history = run(config, (2, 6), burst, 12)
    assert split[0] >= 3 and sum(split) == 8
    reached = predict(*split, burst, PREFILL_COST, DECODE_COST, **SLO).attainment
    best = max(
        predict(p, 8 - p, burst, PREFILL_COST, DECODE_COST, **SLO).attainment for p in range(1, 8)
    )
    assert reached >= best - 0.03
    assert reached > predict(2, 6, burst, PREFILL_COST, DECODE_COST, **SLO).attainment + 0.3
    # With an actuator that starts workers, the burst is met by adding a prefill worker.
    scaling = PlannerConfig(**SLO, can_scale=True, can_switch=False, max_workers=12)
    decision = decide(2, 6, 0, burst, PREFILL_COST, DECODE_COST, scaling, History())
    assert decision.change == Change("add", PREFILL)


def test_scale_down_only_when_the_survivors_fit():
    config = PlannerConfig(**SLO, can_scale=True, max_workers=10, headroom=0.8)
    # Little load on 4:6: a worker goes, and keeps going while the rest fit.
    quiet = traffic(0.2, 300, 50)
    decision = decide(4, 6, 0, quiet, PREFILL_COST, DECODE_COST, config, History())
    assert decision.change is not None and decision.change.action == "remove"
    split, _ = run(config, (4, 6), quiet, 20)
    survivors = predict(*split, quiet, PREFILL_COST, DECODE_COST, **SLO)
    assert sum(split) < 10 and survivors.attainment > 0.95
    assert survivors.prefill_utilization <= 0.8 and survivors.decode_utilization <= 0.8
    # Load that 2 prefill workers carry at 0.7 busy: one of them alone would be 1.4 busy.
    # Still every SLO met by 2; the planner does not take one away.
    rate = 0.7 * 2 / (0.001 * 500 + 0.01 * 500 / 256)
    loaded = traffic(rate, 500, 20)
    at_two = predict(2, 2, loaded, PREFILL_COST, DECODE_COST, **SLO)
    assert at_two.prefill_utilization == pytest.approx(0.7, rel=0.01)
    decision = decide(2, 2, 0, loaded, PREFILL_COST, DECODE_COST, config, History())
    assert (
        decision.change is None
        or decision.change.action != "remove"
        or (decision.change.role != PREFILL)
    )


def test_no_flap_on_a_steady_load_even_a_noisy_one():
    config = PlannerConfig(**SLO)
    rng = random.Random(1)
    history = History()
    prefill, decode = 1, 7
    for _ in range(40):
        load = traffic(1.0 * rng.uniform(0.85, 1.15), int(600 * rng.uniform(0.9, 1.1)), 80)
        decision = decide(prefill, decode, 0, load, PREFILL_COST, DECODE_COST, config, history)
        history.record(decision.change)
        if decision.change is not None:
            dp, dd = decision.change.delta
            prefill, decode = prefill + dp, decode + dd
    assert history.changes, "the split should have moved off 1:7"
    assert count_flaps(history.changes) == 0
    # It went one way only, a few steps, and the noise moved it at most once more.
    assert {change for _, change in history.changes} == {Change("switch", PREFILL)}
    assert len(history.changes) <= 3


def test_the_flap_guard_refuses_a_reversal_within_the_cooldown():
    config = PlannerConfig(**SLO, cooldown_intervals=2)
    history = History()
    history.record(Change("switch", PREFILL))  # made one interval ago
    chatty = traffic(15.0, 50, 300)
    decision = decide(3, 5, 0, chatty, PREFILL_COST, DECODE_COST, config, history)
    assert decision.change is None and "reverse" in decision.reason
    history.record(None)
    history.record(None)  # three intervals on: allowed
    decision = decide(3, 5, 0, chatty, PREFILL_COST, DECODE_COST, config, history)
    assert decision.change == Change("switch", DECODE)
    assert count_flaps([(0, Change("switch", PREFILL)), (2, Change("switch", DECODE))]) == 1
    assert count_flaps([(0, Change("switch", PREFILL)), (3, Change("switch", DECODE))]) == 0


def test_pending_changes_hold_the_next_one():
    config = PlannerConfig(**SLO, max_pending=1)
    burst = traffic(1.8, 1000, 20)
    decision = decide(3, 5, 1, burst, PREFILL_COST, DECODE_COST, config, History())
    assert decision.change is None and "in flight" in decision.reason


@pytest.mark.parametrize(
    ("prefill", "decode", "pending", "load", "cost", "why"),
    [
        (2, 6, 0, Traffic(math.nan, (100,), 10), PREFILL_COST, "arrival rate"),
        (2, 6, 0, Traffic(-3.0, (100,), 10), PREFILL_COST, "arrival rate"),
        (2, 6, 0, Traffic(1.0, (100,), math.inf), PREFILL_COST, "output length"),
        (2, 6, 0, Traffic(1.0, (-5,), 10), PREFILL_COST, "negative prompt"),
        (-1, 6, 0, Traffic(1.0, (100,), 10), PREFILL_COST, "negative worker counts"),
        (2, 6, -2, Traffic(1.0, (100,), 10), PREFILL_COST, "negative worker counts"),
        (2, 6, 0, Traffic(1.0, (100,), 10), StepCost(math.nan, 0.1), "step cost"),
        (2, 6, 0, Traffic(1.0, (100,), 10), StepCost(0.01, -0.1), "step cost"),
    ],
)
def test_nonsense_figures_hold(prefill, decode, pending, load, cost, why):
    config = PlannerConfig(**SLO, can_scale=True, max_workers=10)
    decision = decide(prefill, decode, pending, load, cost, DECODE_COST, config, History())
    assert decision.change is None and why in decision.reason


def test_targets_stay_within_bounds():
    config = PlannerConfig(**SLO, can_scale=True, max_workers=6, min_prefill=1, min_decode=1)
    # No workers at all: the minimums first, a worker at a time.
    decision = decide(0, 0, 0, traffic(1.0, 100, 10), PREFILL_COST, DECODE_COST, config, History())
    assert decision.change == Change("add", PREFILL)
    # A load no number of workers meets: it grows to max_workers and stops there.
    flood = traffic(1e6, 4000, 4000)
    split, _ = run(config, (1, 1), flood, 30)
    assert sum(split) <= 6 and split[0] >= 1 and split[1] >= 1
    # No traffic at all: it shrinks to the minimums, never below.
    split, _ = run(config, (3, 3), traffic(0.0, 100, 10), 30)
    assert split == (1, 1)
    # Without an actuator that starts workers, the total never changes.
    fixed = PlannerConfig(**SLO)
    split, _ = run(fixed, (4, 4), flood, 30)
    assert sum(split) == 8 and min(split) >= 1
    for bad in (
        {"slo_ttft_s": math.nan},
        {"slo_itl_s": -1.0},
        {"max_workers": 1},
        {"min_decode": 0},
        {"headroom": 0.0},
    ):
        with pytest.raises(ValueError):
            PlannerConfig(**{**SLO, **bad})


def test_roles_named_in_changes():
    assert Change("switch", PREFILL).delta == (1, -1)
    assert Change("remove", DECODE).delta == (0, -1)
