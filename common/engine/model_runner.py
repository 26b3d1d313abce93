"""Runs one forward over a scheduled batch and samples each sampling sequence's next tokens.

With a ``Speculator`` the runner first asks it for proposed tokens, appends them to their
sequences' runs, and samples every position from the proposal's first on: the target's own
choice at each position decides how many proposals are accepted (see
``common/engine/speculative/speculator.py``).

In a tensor-parallel group rank 0's runner sends each step's token runs to the other ranks
before its forward (``common/engine/tp_group.py``), and theirs run them in ``run_forward``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import repeat
from typing import Protocol

import torch

from common.engine.batch import (
    ForwardInputs,
    HostStaging,
    PageTables,
    ScheduledSequence,
    TokenRun,
    flatten_decodes,
    flatten_runs,
)
from common.engine.cuda_graphs import DecodeGraphs
from common.engine.kv_pool import KVPool
from common.engine.lora import LoraManager
from common.engine.persistent_batch import DecodeStep
from common.engine.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    draws_from_logits_alone,
    plain_argmax,
    plain_samples,
    prompt_logprobs,
)
from common.engine.speculative.speculator import Speculator
from common.engine.structured.masks import fill_masks
from common.engine.structured.state import GrammarState
from common.engine.tp_group import FollowerRanks
from common.model.llama import LlamaForCausalLM
from kernels.lora import LoraSegments


class AroundForward(AbstractContextManager[object], Protocol):
    """What a worker wraps around a step's forward and sampling (``run``): entered once the
    step's inputs are built, left once its tokens are known. ``device_launched`` is called once
    the forward is launched: on a GPU the host is then free until it waits for the logits, and
    may do its own work there (a worker sends the previous step's tokens)."""

    def device_launched(self) -> None: ...


@dataclass(slots=True)
class LaunchedDecodes:
    """A step of decodes launched on the device whose tokens are not read yet
    (``ModelRunner.collect``)."""

    batch: list[ScheduledSequence]
    token_ids: torch.Tensor  # [rows] on the device: a step launched after it feeds these
    host_token_ids: torch.Tensor  # the same on the host once ``ready`` has passed
    ready: torch.cuda.Event | None  # None on the CPU, where they are there at once


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        sampler: Sampler,
        speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.sampler = sampler
        self.speculator = speculator
        # Set by the engine once the pool is bound: replays pure decode steps (cuda_graphs.py).
        self.graphs: DecodeGraphs | None = None
        self.device = pool.device
        self.page_size = pool.layout.page_size
        self.staging = HostStaging()
        self.page_tables = PageTables()
        # Set by a tensor-parallel group's rank 0: the ranks that run each step beside it.
        self.followers: FollowerRanks | None = None
        # Set by an engine serving LoRA adapters: the slots each step's adapters compute in.
        self.lora: LoraManager | None = None
        # The last batch whose rows were all a plain argmax: the same rows stay so (a row's
        # output only grows, and only min_tokens depends on it), so they are not asked again.
        self._plain_rows: list[ScheduledSequence] = []
        # Pinned buffers the launched steps' token ids are copied into, used in turn: a step is
        # read before the one after next is launched (``launch_decodes``).
        self._host_tokens: list[torch.Tensor] = []
        self._host_turn = 0

    @torch.inference_mode()
    def run(
        self,
        batch: list[ScheduledSequence],
        around_forward: AroundForward | None = None,
    ) -> list[list[SampledToken]]:
        """Forward ``batch``; returns, for each row whose ``samples`` is true, the run of tokens
        it gains: the accepted proposals, then the target's own next token. ``around_forward``
        is entered from the forward's launch to the sampled tokens' arrival, the span in which
        the host has nothing of its own to do (a worker sends its previous step's output then),
        and told when the forward is launched."""
        if not batch:
            return []
        proposals = (
            self.speculator.propose(batch) if self.speculator is not None else [[]] * len(batch)
        )
        decodes_alone = _decodes_alone(batch, proposals)
        runs = None
        if self.followers is not None:
            runs = self.token_runs(batch, proposals)
            self.followers.send_step(runs)
        inputs = self._inputs(batch, proposals, decodes_alone, runs)
        lora = self._lora_segments(batch, proposals)
        with around_forward if around_forward is not None else nullcontext():
            started = time.perf_counter()
            logits = self.graphs.run(inputs, lora) if self.graphs is not None else None
            if logits is None:
                logits = self.model(
                    inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, lora
                )
            if around_forward is not None:
                around_forward.device_launched()
            if decodes_alone and self._all_plain_argmax(batch):
                # The usual step: every row's token is its logits' argmax, nothing else asked.
                sampled = self.sampler.argmax(logits)
            else:
                sampled = self._sample(batch, proposals, logits)
        if not sampled:
            return []
        if self.speculator is None:
            return [[sample] for sample in sampled]
        if all(item.num_new_tokens == 1 for item in batch):
            # What a decode step of this many rows costs: the speculator's price of a slot.
            # (Not the proposing: a draft catching up on a prompt is a cost of that prompt.)
            self.speculator.costs.observe(len(inputs.input_ids), time.perf_counter() - started)
        return self.speculator.accept(batch, proposals, sampled)

    def launches(self, batch: list[ScheduledSequence]) -> bool:
        """Whether ``batch`` is a step ``launch_decodes`` runs: decodes alone, each row's token
        drawn from its logits alone (``draws_from_logits_alone``), with no speculator and no
        other ranks (whose runs are sent token by token before the forward)."""
        return (
            bool(batch)
            and self.speculator is None
            and self.followers is None
            and all(item.num_new_tokens == 1 and item.will_sample for item in batch)
            and (
                self._all_plain_argmax(batch)
                or all(
                    draws_from_logits_alone(item.seq.params, item.seq.num_output_tokens)
                    for item in batch
                )
            )
        )

    @torch.inference_mode()
    def launch_decodes(
        self, batch: list[ScheduledSequence], after: LaunchedDecodes | None = None
    ) -> LaunchedDecodes:
        """Launch the forward and sampling of ``batch`` (``launches`` holds), and the copy of
        its token ids to the host, without waiting for any of it. ``after``: a step launched over
        the same rows whose tokens are not read yet; this one feeds them, a position further
        on (the engine's step ahead), taking them on the device."""
        seqs = [item.seq for item in batch]
        if isinstance(batch, DecodeStep) and batch.current:
            inputs = batch.rows.forward_inputs(self.device, self.staging, batch.lead)
            if after is not None:
                inputs = dataclasses.replace(inputs, input_ids=after.token_ids)
        else:
            inputs = flatten_decodes(
                seqs,
                self.page_size,
                self.device,
                self.staging,
                self.page_tables,
                after=None if after is None else after.token_ids,
            )
        lora = self._lora_segments(batch, [()] * len(batch))
        logits = self.graphs.run(inputs, lora) if self.graphs is not None else None
        if logits is None:
            logits = self.model(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, lora
            )
        if self._all_plain_argmax(batch):
            token_ids = self.sampler.argmax_ids(logits)
        else:
            # A row after a step launched ahead has that step's token among its outputs.
            in_flight = 0 if after is None else 1
            rows = [
                SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, (), in_flight)
                for seq in seqs
            ]
            token_ids = self.sampler.sample_ids(logits, rows)
        if token_ids.device.type != "cuda":
            return LaunchedDecodes(batch, token_ids, token_ids, None)
        self._host_turn ^= 1
        if len(self._host_tokens) < 2 or self._host_tokens[self._host_turn].numel() < len(batch):
            size = max(256, 2 * len(batch))
            self._host_tokens = [torch.empty(size, dtype=torch.long).pin_memory() for _ in "ab"]
        host = self._host_tokens[self._host_turn][: len(batch)]
        host.copy_(token_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedDecodes(batch, token_ids, host, ready)

    def collect(self, launched: LaunchedDecodes) -> list[list[SampledToken]]:
        """A launched step's tokens, a run of one per row, once they are on the host."""
        if launched.ready is not None:
            launched.ready.synchronize()
        return [[sample] for sample in plain_samples(launched.host_token_ids.tolist())]

    def _lora_segments(
        self, batch: list[ScheduledSequence], proposals: Seq[Seq[int]]
    ) -> LoraSegments | None:
        """The step's rows by adapter slot (each sequence's run: its known tokens, then its
        proposals), the adapters written into slots first; None where no row has one."""
        if self.lora is None:
            return None
        if isinstance(batch, DecodeStep) and batch.current:
            rows = batch.rows
            if not rows.num_loras:
                return None
            return self._segments_of(list(zip(repeat(1), rows.lora_names)))
        return self._segments_of(
            [
                (item.num_new_tokens + len(proposed), item.seq.lora_name)
                for item, proposed in zip(batch, proposals, strict=True)
            ]
        )

    def _segments_of(self, rows: list[tuple[int, str | None]]) -> LoraSegments | None:
        """Segments of ``(row count, adapter)`` per sequence, in batch order."""
        if self.lora is None:
            return None
        names = {name for _, name in rows if name is not None}
        if not names:
            return None
        slots = self.lora.slots_for(names)
        return LoraSegments.of_rows(
            [(count, None if name is None else slots[name]) for count, name in rows], self.device
        )

    def _all_plain_argmax(self, batch: list[ScheduledSequence]) -> bool:
        """Whether every row's next token is its logits' argmax and nothing else is asked of it
        (``plain_argmax``)."""
        if isinstance(batch, DecodeStep) and batch.current:
            return batch.rows.all_plain_argmax()
        if batch == self._plain_rows:  # the same rows: item by item, by identity first
            return True
        if all(plain_argmax(item.seq.params, item.seq.num_output_tokens) for item in batch):
            self._plain_rows = batch
            return True
        return False

    def _sample(
        self, batch: list[ScheduledSequence], proposals: Seq[Seq[int]], logits: torch.Tensor
    ) -> list[SampledToken]:
        """Score any prompt tokens due, then sample every sampling row: a sequence's next
        token, after each of its proposals."""
        if any(item.seq.num_prompt_logprobs_due for item in batch):
            logits = self._score_prompts(batch, proposals, logits)
        rows: list[SamplingRow] = []
        grammars: list[tuple[GrammarState | None, Seq[int]]] = []
        for item, proposed in zip(batch, proposals, strict=True):
            if not item.will_sample:
                continue
            seq = item.seq
            # The row after j accepted proposals sees them as already generated: penalties,
            # min_tokens, a seeded row's noise and its grammar all follow.
            for j in range(len(proposed) + 1):
                rows.append(
                    SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, proposed[:j])
                )
            grammars.append((seq.grammar, proposed))
        if not rows:
            return []
        # On the host while the device still computes the logits (a GPU's forward is launched,
        # not run): the sampler waits for them only after this.
        masks = fill_masks(grammars, self.sampler.vocab_size)
        return self.sampler.sample(logits, rows, masks)

    @torch.inference_mode()
    def run_forward(self, runs: list[TokenRun]) -> None:
        """A tensor-parallel rank other than 0: the forward rank 0 runs over ``runs``, for its
        collectives and this rank's KV pages; the logits are rank 0's to sample."""
        inputs = flatten_runs(runs, self.page_size, self.device, self.staging, self.page_tables)
        # Every rank writes a step's adapters into the same slots: the same calls, in order.
        lora = self._segments_of([(len(run.token_ids), run.lora_name) for run in runs])
        self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, lora)

    def prepare(self, batch: list[ScheduledSequence], proposals: Seq[Seq[int]]) -> ForwardInputs:
        """The forward's inputs: each sequence's next known tokens, then its proposals, with
        logits for every position from its last known token on (and, for prompt logprobs, for
        the chunk's prompt positions before it). A step of decodes alone, the usual one, is
        built straight from its sequences."""
        return self._inputs(batch, proposals, _decodes_alone(batch, proposals))

    def _inputs(
        self,
        batch: list[ScheduledSequence],
        proposals: Seq[Seq[int]],
        decodes_alone: bool,
        runs: list[TokenRun] | None = None,
    ) -> ForwardInputs:
        """``prepare`` with the step's kind known, and its token runs if already made."""
        if decodes_alone and isinstance(batch, DecodeStep) and batch.current:
            return batch.rows.forward_inputs(self.device, self.staging, batch.lead)
        if decodes_alone:
            seqs = [item.seq for item in batch]
            return flatten_decodes(
                seqs, self.page_size, self.device, self.staging, self.page_tables
            )
        return flatten_runs(
            runs if runs is not None else self.token_runs(batch, proposals),
            self.page_size,
            self.device,
            self.staging,
            self.page_tables,
        )

    def token_runs(
        self, batch: list[ScheduledSequence], proposals: Seq[Seq[int]]
    ) -> list[TokenRun]:
        """Each sequence's run of tokens for the forward (see ``prepare``)."""
        runs = []
        for item, proposed in zip(batch, proposals, strict=True):
            seq, start = item.seq, item.seq.num_computed_tokens
            known = seq.token_ids[start : start + item.num_new_tokens]
            num_logits = _prompt_positions_to_score(item)[1]
            num_logits += 1 + len(proposed) if item.will_sample else 0
            runs.append(
                TokenRun(known + list(proposed), start, seq.page_ids, num_logits, seq.lora_name)
            )
        return runs

    def _score_prompts(
        self, batch: list[ScheduledSequence], proposals: Seq[Seq[int]], logits: torch.Tensor
    ) -> torch.Tensor:
        """Record the prompt logprobs this forward computed on their sequences; returns the
        logits rows that sample, in batch order."""
        sampling_rows: list[int] = []
        row = 0
        for item, proposed in zip(batch, proposals, strict=True):
            first, count = _prompt_positions_to_score(item)
            if count:
                seq = item.seq
                # Position p's logits score prompt token p + 1.
                targets = seq.token_ids[first + 1 : first + 1 + count]
                # Columns past the vocabulary are the model's padding, never a token.
                rows = logits[row : row + count, : self.sampler.vocab_size]
                seq.prompt_logprobs += prompt_logprobs(
                    rows, targets, seq.params.prompt_logprobs or 0
                )
                row += count
            if item.will_sample:
                sampling_rows += range(row, row + 1 + len(proposed))
                row += 1 + len(proposed)
        return logits[sampling_rows]


def _decodes_alone(batch: list[ScheduledSequence], proposals: Seq[Seq[int]]) -> bool:
    """Whether every sequence of the step feeds one token, its newest, and samples after it
    (no prompt chunk, no proposal). Such a step scores no prompt token: a sequence's prompt
    logprobs are all due before its last prompt position, whose logits sample."""
    if isinstance(batch, DecodeStep):
        return not any(proposals)
    return not any(proposals) and all(
        item.num_new_tokens == 1 and item.will_sample for item in batch
    )


def _prompt_positions_to_score(item: ScheduledSequence) -> tuple[int, int]:
    """(first position, count) of this step's positions whose logits score a prompt token for
    ``prompt_logprobs``: the chunk's positions from the next unscored one up to the prompt's
    second to last (the last one's logits choose the first output token). They end where the
    chunk does, or just before its sampling position, so they are the run's last logits rows
    before the sampling ones."""
    seq = item.seq
    if not seq.num_prompt_logprobs_due:
        return 0, 0
    start = seq.num_computed_tokens
    first = len(seq.prompt_logprobs)  # the next position to score
    end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    if first < start:  # its KV came from elsewhere (shipped): nothing here to score
        return 0, 0
    return first, max(0, end - first)
