"""TTFT and ITL of a candidate split, and the share of requests meeting both SLOs.

Queueing estimates over the fitted step costs (``fit.py``), per pool, with the arrivals split
evenly over its workers:

- Prefill: a worker is an M/G/1 queue whose service time is a prompt's compute at full steps
  (``tokens * per_token_s`` plus its share of the steps' fixed and per-row costs), varying as
  the observed prompts' lengths do. A request's TTFT is its own prefill (its chunks, each a step
  of its own) plus the queue's wait: Kingman's mean, ``rho / (1 - rho) * S * (1 + cs2) / 2``
  (cs2: the squared coefficient of variation of the service times; 1 gives M/M/1, 0 M/D/1), with
  an exponential tail, ``P(wait > t) = rho * exp(-t * rho / mean wait)``. At ``rho >= 1`` nothing
  is met.
- Decode: a worker runs N sequences at once, each one token a step; by Little's law
  ``N = (arrivals / D) * output_tokens * ITL``, and a step of N rows costs
  ``fixed + (per_token + per_seq + per_context * context) * N``, so
  ``ITL = fixed / (1 - (arrivals / D) * output_tokens * (per_token + per_seq + per_context *
  context))``, unbounded where that is not positive, or where N outgrows the worker's KV pool
  or its ``max_num_seqs``.

The attainment of a split is the mean over the observed prompts of ``P(TTFT ok) * [ITL ok]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.fit import StepCost


@dataclass(frozen=True, slots=True)
class Traffic:
    """What arrives: requests per second, each arrival's prompt length, and the mean output
    tokens a request generates."""

    rate: float
    prompt_tokens: tuple[int, ...]
    output_tokens: float

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_tokens) / len(self.prompt_tokens) if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PoolShape:
    """A pool's limits per worker: the token budget of a step, the sequences and the KV tokens
    it holds."""

    token_budget: int = 256
    max_num_seqs: int = 256
    kv_tokens: int = 1 << 20


@dataclass(frozen=True, slots=True)
class Prediction:
    prefill: int
    decode: int
    ttft_s: float  # the mean TTFT (inf: the prefill pool is overloaded)
    itl_s: float  # the decode step at the predicted batch (inf: overloaded)
    prefill_utilization: float
    decode_utilization: float
    attainment: float  # the share of requests meeting both SLOs, 0..1


def predict(
    prefill: int,
    decode: int,
    traffic: Traffic,
    prefill_cost: StepCost,
    decode_cost: StepCost,
    slo_ttft_s: float,
    slo_itl_s: float,
    prefill_shape: PoolShape = PoolShape(),
    decode_shape: PoolShape = PoolShape(),
    decode_context_cost_s: float = 0.0,
) -> Prediction:
    """The prediction for ``prefill`` : ``decode`` workers (``decode_context_cost_s``: the
    decode step's cost per token of context attended, beside the fit's)."""
    rate = traffic.rate if math.isfinite(traffic.rate) and traffic.rate > 0 else 0.0
    prompts = traffic.prompt_tokens or (1,)
    budget = max(1, prefill_shape.token_budget)

    def prefill_alone(tokens: int) -> float:
        """One prompt's prefill with nothing else queued: its chunks, a step each."""
        chunks = max(1, math.ceil(tokens / budget))
        return (
            chunks * prefill_cost.fixed_s
            + prefill_cost.per_token_s * tokens
            + (chunks * prefill_cost.per_seq_s)
        )

    def service(tokens: float) -> float:
        """A prompt's share of a prefill worker at load, where steps are full: the fixed cost
        shared by a budget's worth of tokens."""
        return (
            prefill_cost.per_token_s * tokens
            + prefill_cost.fixed_s * tokens / budget
            + prefill_cost.per_seq_s
        )

    mean_prompt = sum(prompts) / len(prompts)
    services = [service(tokens) for tokens in prompts]
    service_s = sum(services) / len(services)
    spread = sum((x - service_s) ** 2 for x in services) / len(services)
    cs2 = spread / service_s**2 if service_s > 0 else 0.0
    rho_p = rate / prefill * service_s if prefill > 0 else math.inf
    # Decode: Little's law over a step that grows with the rows it holds.
    output = max(1.0, traffic.output_tokens)
    context = mean_prompt + output / 2
    per_row = decode_cost.per_token_s + decode_cost.per_seq_s + decode_context_cost_s * context
    load = rate / decode * output * per_row if decode > 0 else math.inf
    if load < 1:
        itl = decode_cost.fixed_s / (1 - load) + per_row  # at least one row
        rows = rate / decode * output * itl
        if rows > decode_shape.max_num_seqs or rows * context > decode_shape.kv_tokens:
            itl = math.inf
    else:
        itl = math.inf
    itl_ok = itl <= slo_itl_s
    if rho_p >= 1:
        ttft_met = 0.0
        mean_ttft = math.inf
    else:
        met = 0.0
        total_ttft = 0.0
        wait_mean = rho_p / (1 - rho_p) * service_s * (1 + cs2) / 2
        for tokens in prompts:
            own = prefill_alone(tokens)
            slack = slo_ttft_s - own
            if slack >= 0:
                met += 1 - rho_p * math.exp(-slack * rho_p / max(wait_mean, 1e-12))
            total_ttft += own + wait_mean
        ttft_met = met / len(prompts)
        mean_ttft = total_ttft / len(prompts)
    return Prediction(
        prefill,
        decode,
        mean_ttft,
        itl,
        rho_p,
        load,
        ttft_met if itl_ok else 0.0,
    )
