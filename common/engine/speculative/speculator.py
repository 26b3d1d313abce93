"""Plans, proposes and verifies speculative tokens inside the decode step.

Verification is "sample, then compare": the target samples every position of a sequence's run
(its last known token, then each proposal) exactly as it would without speculation, and the
proposals are accepted up to the first one that differs from the target's own sample there. The
target's sample at that position (after the last proposal: the bonus token) ends the run.

This is rejection sampling for proposers that put all their mass on one token, as n-gram lookup
and a greedily decoding draft model do: a proposal ``d`` where the target's distribution is ``p``
is accepted with probability ``p(d)``, and on rejection the token emitted follows ``p`` without
``d`` renormalised, which is ``(p - q)+`` renormalised for a one-hot ``q``. The output therefore
follows the target's distribution exactly. Better still, a seeded request's noise depends only on
``(seed, step)`` (``common/engine/sampler.py``), so speculation changes not one token of a greedy
or seeded request: it only changes how many of them one step yields.

How many tokens to propose is decided per step, for the whole batch, by what they are likely
to earn and what they cost. Each sequence keeps a moving average of its acceptance, so its
``j``-th slot yields a token with chance about ``acceptance ** j``; each slot is one more row
of the forward, and what rows cost is measured on this very engine (``StepCosts``: on a GPU or
a CPU at batch 1 rows are nearly free, on a CPU core already computing eight rows they are
not). The step takes the slots, likeliest first, that maximise expected tokens per second,
going only a few rows past the largest step measured so far.
A sequence whose acceptance collapses stops proposing for ``_IDLE_STEPS`` steps (twice as long
after each further collapse) and then tries a single token again; above
``disable_by_batch_size`` decoding sequences nobody proposes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from common.config import SpeculativeConfig
from common.engine.batch import ScheduledSequence
from common.engine.sampler import SampledToken
from common.engine.sequence import Sequence
from common.metrics import SPEC_ACCEPTED, SPEC_ACCEPTED_PER_STEP, SPEC_PROPOSED

# Weight of the latest step in a sequence's moving average of acceptance.
_ACCEPTANCE_WEIGHT = 0.25
# A slot is never used when the chance of reaching it, acceptance ** j, is below this. Low on
# purpose: what a slot earns against what its row costs is weighed per step; this only keeps
# hopeless slots out. (At batch 1 on a CPU core, where a few more rows cost little, n-gram
# lookup on code-copying prompts gained 1.31x with 0.2 here and 1.43x with 0.05.)
_MIN_ACCEPT_CHANCE = 0.05
# After acceptance collapses: steps without proposals before one token is tried again, doubled
# for each collapse since the last accepted token, at most _MAX_DOUBLINGS times.
_IDLE_STEPS = 16
_MAX_DOUBLINGS = 4
# Row counts past the largest measured are estimated optimistically (see StepCosts), which is
# how their cost gets measured; a step goes at most this share of its plain rows past that
# count (at least one row), so a large batch learns what rows cost a few at a time instead of
# paying for one huge step first (at batch 8 on a CPU core, 32 untried rows cost two steps).
_EXPLORE_SHARE = 0.25
# Weight of the latest measurement in StepCosts' moving averages; steps after which a figure is
# forgotten, and after which the plain step's figure is measured again.
_COST_WEIGHT = 0.2
_MAX_AGE = 64
_REFRESH_AGE = 32


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """At most ``num_tokens[i]`` proposed next tokens for each of ``seqs``."""


class StepCosts:
    """Seconds of a decode-only step's forward and sampling by its row count, as
    measured: a moving average per row count. A count not run yet is estimated from its
    neighbours: linearly between the nearest two, and flat past the largest, which is
    optimistic on purpose: taking more rows is how their cost gets measured.

    Steps grow dearer as contexts grow, so a figure not measured for ``_MAX_AGE`` steps is
    forgotten, and the plain step's own figure is kept fresh (``needs_plain_step``): an old,
    cheap figure for more rows would make speculation look better than it is."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._measured_at: dict[int, int] = {}
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._steps += 1
        known = self._seconds.get(rows)
        self._seconds[rows] = seconds if known is None else known + _COST_WEIGHT * (seconds - known)
        self._measured_at[rows] = self._steps
        for old in [r for r, at in self._measured_at.items() if at < self._steps - _MAX_AGE]:
            del self._seconds[old], self._measured_at[old]

    def largest_measured(self) -> int:
        """The largest row count with a figure; 0 while nothing is measured."""
        return max(self._seconds, default=0)

    def needs_plain_step(self, rows: int) -> bool:
        """Whether the figure for ``rows`` (a step without proposals) is missing or stale."""
        return self._steps - self._measured_at.get(rows, -_MAX_AGE) > _REFRESH_AGE

    def estimate(self, rows: int) -> float | None:
        """None while nothing is measured."""
        if rows in self._seconds:
            return self._seconds[rows]
        below = max((r for r in self._seconds if r < rows), default=None)
        above = min((r for r in self._seconds if r > rows), default=None)
        if below is None:
            return None if above is None else self._seconds[above]
        if above is None:
            return self._seconds[below]
        low, high = self._seconds[below], self._seconds[above]
        return low + (high - low) * (rows - below) / (above - below)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.costs = StepCosts()

    def plan_slots(self, decoding: list[Sequence], max_model_len: int) -> list[int]:
        """How many proposed tokens each decoding sequence may verify this step (0: a plain
        decode). Called once per step."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(decoding) > limit:
            return [0] * len(decoding)
        # Every slot worth considering, likeliest first; a sequence's later slots are never
        # likelier than its earlier ones, so any prefix of this order is a valid plan.
        candidates = sorted(
            (seq.speculation.acceptance**j, j, i)
            for i, seq in enumerate(decoding)
            for j in range(1, self._max_slots(seq, max_model_len) + 1)
        )
        candidates.reverse()
        rows = len(decoding)
        base_seconds = self.costs.estimate(rows)
        if candidates and base_seconds is not None and self.costs.needs_plain_step(rows):
            return [0] * len(decoding)  # measure the step speculation has to beat
        # The most rows this step may run: a little past what has been measured.
        frontier = max(self.costs.largest_measured(), rows) + max(1, int(rows * _EXPLORE_SHARE))
        candidates = candidates[: max(0, frontier - rows)]
        take, best_rate, expected = len(candidates), None, float(rows)
        if base_seconds is not None:
            take, best_rate = 0, rows / base_seconds
            for n, (chance, _, _) in enumerate(candidates, start=1):
                expected += chance
                seconds = self.costs.estimate(rows + n)
                assert seconds is not None  # some step is measured: base_seconds is not None
                rate = expected / seconds
                if rate > best_rate:
                    take, best_rate = n, rate
        slots = [0] * len(decoding)
        for _, _, i in candidates[:take]:
            slots[i] += 1
        return slots

    def _max_slots(self, seq: Sequence, max_model_len: int) -> int:
        """The most slots ``seq`` could use: as many as its acceptance makes worth a try, none
        while it pauses, and never past max_tokens or the model's length (the run's last token
        is always the target's own)."""
        state = seq.speculation
        if state.idle_steps > 0:
            state.idle_steps -= 1
            return 0
        k = self.config.num_speculative_tokens
        while k > 0 and state.acceptance**k < _MIN_ACCEPT_CHANCE:
            k -= 1
        if k == 0:
            # Each collapse in a row pauses twice as long: a proposer that never agrees with
            # this sequence (a poor draft, text with nothing to look up) soon costs nothing.
            state.idle_steps = _IDLE_STEPS << min(state.collapses, _MAX_DOUBLINGS)
            state.collapses += 1
            state.acceptance = _MIN_ACCEPT_CHANCE  # the probe after the pause proposes one
            return 0
        tokens_left = seq.params.max_tokens - seq.num_output_tokens - 1
        room = max_model_len - seq.num_tokens - 1
        return max(0, min(k, tokens_left, room))

    def propose(self, batch: list[ScheduledSequence]) -> list[list[int]]:
        """Proposed tokens for every row of ``batch``, [] where it has no slots."""
        chosen = [i for i, item in enumerate(batch) if item.num_draft_slots > 0]
        proposals: list[list[int]] = [[] for _ in batch]
        if not chosen:
            return proposals
        found = self.proposer.propose(
            [batch[i].seq for i in chosen], [batch[i].num_draft_slots for i in chosen]
        )
        for i, tokens in zip(chosen, found, strict=True):
            proposals[i] = tokens[: batch[i].num_draft_slots]
        return proposals

    def accept(
        self,
        batch: list[ScheduledSequence],
        proposals: Seq[Seq[int]],
        sampled: Seq[SampledToken],
    ) -> list[list[SampledToken]]:
        """Split the samples (one per position from each sampling row's last known token on)
        into each row's run: the target's samples up to and including its first disagreement
        with the proposals."""
        runs = []
        at = 0
        for item, proposed in zip(batch, proposals, strict=True):
            if not item.will_sample:
                continue
            samples = sampled[at : at + len(proposed) + 1]
            at += len(proposed) + 1
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == samples[accepted].token_id:
                accepted += 1
            runs.append(list(samples[: accepted + 1]))
            if proposed:
                self._record(item.seq, len(proposed), accepted)
        return runs

    def _record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        SPEC_PROPOSED.inc(num_proposed)
        SPEC_ACCEPTED.inc(num_accepted)
        SPEC_ACCEPTED_PER_STEP.observe(num_accepted)
        # Proposals after the first rejected one were never tested.
        tested = num_accepted + (num_accepted < num_proposed)
        state = seq.speculation
        if num_accepted:
            state.collapses = 0
        state.acceptance += _ACCEPTANCE_WEIGHT * (num_accepted / tested - state.acceptance)
