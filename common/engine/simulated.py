"""The simulated engine: a worker's real scheduler, page manager and wire over a model runner that
sleeps for the time a cost model gives each step, and emits deterministic tokens.

It lets the router, the planner and the drain be exercised with many workers on a few cores: a
simulated worker spends its steps asleep, not computing. Its KV pages are real but tiny (one
layer, one head of eight values), so handoffs and transfers still run over the real sockets,
cheaply. No weights are loaded; the model folder is read for its configuration alone (the
vocabulary and end-of-sequence ids that tokens are drawn from, the context length), and the
router tokenizes with that folder's tokenizer as it would for the real model.

A step's time (``CostModel.step_seconds``, ``common/cost_model.py``)::

    fixed_s + per_token_s * new tokens + per_seq_s * rows + per_context_token_s * attended tokens

where the attended tokens are the context every row reads (its computed tokens plus its new
ones). ``benchmarks/planner_cost.py`` fits one from this box's real steps; the committed
models live in ``benchmarks/cost_models/``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import nullcontext

from common.cost_model import CostModel
from common.engine.batch import ScheduledSequence
from common.engine.sampler import SampledToken

# The simulated pages' shape: one layer, one KV head of this many values per token.
SIM_NUM_LAYERS = 1
SIM_NUM_KV_HEADS = 1
SIM_HEAD_DIM = 8


class SimulatedModel:
    """The model's place in a simulated engine: what a worker may set on a model (the threads
    a core loan lends its layers), kept and never used."""

    layer_threads: object = None


class SimulatedRunner:
    """``ModelRunner``'s place in a simulated engine: ``run`` sleeps for the step's cost and
    returns one token per sampling row. A token is a function of its sequence alone (its last
    token and length), never an end-of-sequence id, so every worker gives a request the same
    answer and it runs to its ``max_tokens``."""

    speculator = None
    followers = None
    lora = None
    graphs = None

    def __init__(self, cost: CostModel, vocab_size: int, eos_token_ids: Iterable[int]):
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.slept_s = 0.0  # the steps' simulated time in total

    def run(self, batch: list[ScheduledSequence], around_forward=None) -> list[list[SampledToken]]:
        if not batch:
            return []
        new_tokens = 0
        context = 0
        for item in batch:
            new_tokens += item.num_new_tokens
            context += item.seq.num_computed_tokens + item.num_new_tokens
        seconds = self.cost.step_seconds(new_tokens, len(batch), context)
        deadline = time.perf_counter() + seconds
        with around_forward if around_forward is not None else nullcontext():
            if around_forward is not None:
                around_forward.device_launched()
            # Sleep out what the helper's work during the "forward" left of the step.
            left = deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)
        self.slept_s += seconds
        return [
            [SampledToken(self.token_after(item.seq.token_ids))]
            for item in batch
            if item.will_sample
        ]

    def launches(self, batch: list[ScheduledSequence]) -> bool:
        return False  # never a step launched ahead: there is no device to keep busy

    def token_after(self, token_ids: list[int]) -> int:
        token = (token_ids[-1] * 31 + len(token_ids) * 17 + 7) % self.vocab_size
        while token in self.eos:
            token = (token + 1) % self.vocab_size
        return token
