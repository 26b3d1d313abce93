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

Speculation backs off per sequence: a moving average of its acceptance decides how many slots
are worth a row of the forward (slot ``j`` is used while ``acceptance ** j`` stays above
``_MIN_ACCEPT_CHANCE``); when not even one is, the sequence stops proposing for ``_IDLE_STEPS``
steps and then tries a single token again. Above ``disable_by_batch_size`` decoding sequences
nobody proposes: the step is already full of rows.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from common.config import SpeculativeConfig
from common.engine.sampler import SampledToken
from common.engine.scheduler import ScheduledSequence
from common.engine.sequence import Sequence
from common.metrics import SPEC_ACCEPTED, SPEC_ACCEPTED_PER_STEP, SPEC_PROPOSED

# Weight of the latest step in a sequence's moving average of acceptance.
_ACCEPTANCE_WEIGHT = 0.25
# A proposal slot is used while the chance of reaching it, acceptance ** j, stays above this.
_MIN_ACCEPT_CHANCE = 0.3
# After acceptance collapses: steps without proposals before one token is tried again.
_IDLE_STEPS = 16


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """At most ``num_tokens[i]`` proposed next tokens for each of ``seqs``."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer

    def plan_slots(self, seq: Sequence, num_decoding: int, max_model_len: int) -> int:
        """How many proposed tokens ``seq`` may verify this step (0: a plain decode). Called
        once per step for each decoding sequence the scheduler takes."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_decoding > limit:
            return 0
        state = seq.speculation
        if state.idle_steps > 0:
            state.idle_steps -= 1
            return 0
        k = self.config.num_speculative_tokens
        while k > 0 and state.acceptance**k < _MIN_ACCEPT_CHANCE:
            k -= 1
        if k == 0:
            state.idle_steps = _IDLE_STEPS
            state.acceptance = _MIN_ACCEPT_CHANCE  # the probe after the pause proposes one
            return 0
        # The run's last token is always the target's own: proposals beyond max_tokens or the
        # model's length could never be used.
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
            if not item.samples:
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
        state.acceptance += _ACCEPTANCE_WEIGHT * (num_accepted / tested - state.acceptance)
