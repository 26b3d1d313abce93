"""Step cost fitted online: least squares of a step's wall time on what it computed.

Each pool's workers report, per heartbeat, how many steps they took, their wall time and the
tokens and rows those steps held (``router/registry.py``, ``GET /v1/workers``). The planner turns
two reports into one observation, the mean step of that span, and fits

    step_s = fixed_s + per_token_s * tokens + per_seq_s * rows

over the latest observations of the pool. A fit with too few or too alike observations keeps its
prior (a cost model's figures, ``common/engine/simulated.py``) in the coefficients it cannot
tell; no coefficient is ever negative.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

# Observations kept per pool: a few minutes of heartbeats from a handful of workers.
WINDOW = 256


@dataclass(frozen=True, slots=True)
class StepCost:
    """What a step of ``tokens`` new tokens over ``rows`` sequences takes, in seconds."""

    fixed_s: float
    per_token_s: float
    per_seq_s: float = 0.0

    def seconds(self, tokens: float, rows: float) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_seq_s * rows


@dataclass(frozen=True, slots=True)
class StepSample:
    """The mean step of a span: its tokens, rows and seconds, and how many steps it averages."""

    tokens: float
    rows: float
    seconds: float
    steps: int = 1

    def usable(self) -> bool:
        values = (self.tokens, self.rows, self.seconds)
        return (
            all(math.isfinite(v) and v >= 0 for v in values)
            and self.seconds > 0
            and self.steps > 0
            and self.rows > 0
        )


class StepCostFitter:
    """The fit of one pool. ``observe`` ignores nonsense (negative, NaN, empty spans);
    ``cost`` is the current fit, ``prior`` until observations tell it apart."""

    def __init__(self, prior: StepCost, window: int = WINDOW) -> None:
        self.prior = prior
        self.samples: deque[StepSample] = deque(maxlen=window)

    def observe(self, sample: StepSample) -> bool:
        if not sample.usable():
            return False
        self.samples.append(sample)
        return True

    def cost(self) -> StepCost:
        return fit_step_cost(list(self.samples), self.prior)


def fit_step_cost(samples: list[StepSample], prior: StepCost) -> StepCost:
    """Weighted least squares (each sample weighs its step count) of seconds on (1, tokens,
    rows), non-negative: a coefficient the fit drives below zero is held at zero and the rest
    refitted. Where the samples do not vary in a feature, the prior's coefficient for it is
    kept and only the rest fitted to what is left."""
    if not samples:
        return prior
    tokens = np.array([s.tokens for s in samples], dtype=np.float64)
    rows = np.array([s.rows for s in samples], dtype=np.float64)
    seconds = np.array([s.seconds for s in samples], dtype=np.float64)
    weights = np.sqrt(np.array([s.steps for s in samples], dtype=np.float64))
    columns = {"fixed_s": np.ones_like(tokens), "per_token_s": tokens, "per_seq_s": rows}
    kept = {
        "fixed_s": prior.fixed_s,
        "per_token_s": prior.per_token_s,
        "per_seq_s": prior.per_seq_s,
    }
    free = ["fixed_s"]
    # A feature that does not vary cannot be told from the fixed cost.
    for name in ("per_token_s", "per_seq_s"):
        if np.ptp(columns[name]) > 1e-9 * max(1.0, float(np.max(np.abs(columns[name])))):
            free.append(name)
    target = seconds - sum(kept[n] * columns[n] for n in kept if n not in free)
    while free:
        matrix = np.stack([columns[n] for n in free], axis=1) * weights[:, None]
        solution, *_ = np.linalg.lstsq(matrix, target * weights, rcond=None)
        negative = [n for n, v in zip(free, solution, strict=True) if v < 0]
        if not negative:
            fitted = dict(zip(free, (float(v) for v in solution), strict=True))
            return StepCost(**{**kept, **fitted})
        # Held at zero: drop the most negative, refit the rest.
        worst = min(negative, key=lambda n: solution[free.index(n)])
        free.remove(worst)
        kept[worst] = 0.0
    return StepCost(**kept)
