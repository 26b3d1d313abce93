"""Chunked prefill plus continuous batching under one token budget per step.

Every step the scheduler fills a budget of new tokens (``token_budget``, vLLM's
``max_num_batched_tokens``): first one token for each running sequence that is decoding, then the
next chunk of each running sequence that is still prefilling, then new sequences from the waiting
queue (first come, first served), each starting after whatever prefix the cache already holds.
Shortest prompt first, though: the running prompts leave room for the waiting ones at the head of
the queue that are shorter than all of their remainders, up to three quarters of the step's prompt
tokens (a chat queued behind a long document would otherwise wait for every one of its chunks). When
pages run out, the newest running sequence is preempted: its pages are freed and it goes back to the
front of the queue to be recomputed later (full pages it had filed in the prefix cache usually make
that cheap).

With a ``Speculator``, a decoding sequence may also take slots for proposed tokens: its pages
and budget cover the run ``last token + proposals``, the runner verifies the proposals in the
same forward, and ``postprocess`` appends the accepted run, checking every stop condition token
by token. Only positions whose tokens were accepted count as computed, so the KV written for
rejected proposals is simply overwritten later and never reaches the prefix cache.

Where every layer of the model attends through a sliding window (``release_window``), a running
sequence gives back each page that no later step reads, once all of its positions are behind the
window of the first position still to compute (``Sequence.num_released_pages``).

The running sequences are also the rows of a ``PersistentBatch`` (persistent_batch.py), in
running order: every change the scheduler makes to a running sequence's tokens, computed count
or pages is told to it (a row added at admission, removed at a finish, a preemption or an
abort, a page appended, a row read again after a step that changed it one by one). The usual
step, the last step's decodes again with no row come or gone (``_steady_decodes``), is decided
and postprocessed on those rows as a ``DecodeStep``, without a pass over the sequences.

Beside a GPU the engine may launch a step before the last one's tokens are read
(``schedule_ahead``, see ``common/engine/llm_engine.py``): the same decodes again, one position
on, their input ids taken on the device from the step before. It is decided only where that is
the step ``schedule`` would give whatever those tokens are, stops aside: a row whose sequence
stopped at the token before is computed for nothing and dropped in ``postprocess``. Pages
freed while such a step is in flight are held back until it is read (``release_held_pages``),
since its forward still writes one slot in them.

A sequence under a LoRA adapter that is in neither host memory nor a device slot is set aside
(``loading``) while the adapter is read off the step thread, as one whose grammar compiles is
(``compiling``); both join the queue when ready, in the order they came.

With KV tiers below the pool (``tiers``), a waiting sequence whose prompt continues past the
pool's prefix match into pages a tier holds is set aside (``restoring``) with fresh pages while
the mover copies those pages up; it is not scheduled until they land, and the step goes on
without it. Once they have, they are filed in the prefix cache and it goes back to the head of
the queue, where its admission finds them as any prefix hit. An abort meanwhile gives back the
pool hits at once and the pages being written once the mover is done with them.

``Scheduler`` serves whole requests (the one-process engine); ``DecodeScheduler`` also holds
the pages of prompts whose KV is on its way from a prefill worker (``reserve``, then
``admit_prefilled`` or ``drop_reservation``); ``PrefillScheduler`` lets each request go after
its first token, keeping its pages for the handoff until ``release``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from itertools import repeat
from operator import itemgetter
from typing import Protocol

import numpy as np

from common.config import SchedulerConfig
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.kv_tiers.tiers import KVTiers, Restore
from common.engine.page_manager import PageManager
from common.engine.persistent_batch import DecodeOutputs, DecodeStep, PersistentBatch
from common.engine.sampler import SampledToken
from common.engine.sequence import FinishReason, Sequence, SequenceStatus, SpeculationState
from common.engine.speculative.speculator import Speculator
from common.engine.structured.compiler import GrammarCompiler
from common.engine.structured.matcher import GrammarError
from common.engine.structured.state import GrammarState
from common.hashing import page_hashes
from kernels.sizes import ceil_div

_FIRST = itemgetter(0)

# How long a step with nothing to run waits for a restore to land before it returns.
_RESTORE_WAIT_S = 0.05


class AdapterSource(Protocol):
    """What the scheduler asks of the engine's LoRA adapters (common/engine/lora.py)."""

    def ready(self, name: str) -> bool:
        """Whether a step may compute under adapter ``name`` now; if not, it is being fetched
        off the step thread. ``ValueError`` if it cannot be."""
        ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        page_manager: PageManager,
        max_model_len: int,
        eos_token_ids: Seq[int],
        speculator: Speculator | None = None,
        grammars: GrammarCompiler | None = None,
        release_window: int | None = None,
    ) -> None:
        """``release_window``: the sliding window every layer of the model attends through,
        behind which a running sequence's pages go back to the pool; None: a sequence keeps
        all its pages until it ends."""
        self.token_budget = config.token_budget
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        self.max_model_len = max_model_len
        self.page_manager = page_manager
        self.page_size = page_manager.page_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences under a structured output whose grammar is compiling: they join ``waiting``
        # once it is compiled, so a slow grammar holds up no one else. Those whose grammar
        # could not be compiled wait in ``failed`` for the caller to tell their clients.
        self.grammars = grammars
        self.compiling: list[Sequence] = []
        self.failed: list[tuple[Sequence, str]] = []
        self.num_preemptions = 0
        # With LoRA: the most adapters the running sequences may compute under at once (the
        # device's slots); a waiting sequence of another adapter waits. None: no limit.
        self.max_adapters: int | None = None
        # With LoRA: the engine's adapters (common/engine/lora.py's LoraManager), and the
        # sequences set aside while theirs is read back into host memory off this thread.
        self.adapters: AdapterSource | None = None
        self.loading: list[Sequence] = []
        self.release_window = release_window
        self.num_released_pages = 0  # pages given back from behind the window, in all
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, cache hits not
        # The running sequences as rows of arrays, in running order (persistent_batch.py):
        # every change to a running sequence's tokens, computed count or pages is told to it.
        self.batch = PersistentBatch(self.page_size, max_model_len, eos_token_ids)
        # The last step's batch when it was every running sequence decoding, in running order
        # (as a ``DecodeStep`` of the rows, and as it was scheduled): while no row comes or
        # goes, the next step is the same rows again (``_steady_decodes``).
        self._decodes: DecodeStep | None = None
        self._decodes_of: list[ScheduledSequence] | None = None
        # Pages freed while a step launched ahead may still write to them (schedule_ahead).
        self._holding_freed_pages = False
        self._held_pages: list[list[int]] = []
        # KV tiers below the pool (set by the engine where configured): sequences whose pages
        # are on their way up, and restores of aborted ones whose pages go back once done.
        self.tiers: KVTiers | None = None
        self.restoring: list[tuple[Sequence, Restore]] = []
        self._abandoned: list[Restore] = []

    # -- admission ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens < 1:
            raise ValueError("the prompt must contain at least one token")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_tokens} tokens, but the maximum model length is "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        seq.queued_time = time.monotonic()
        spec = seq.params.structured
        if spec is not None and seq.grammar is None:
            if self.grammars is None:
                raise ValueError("this engine serves no structured outputs")
            seq.grammar = GrammarState(spec, self.grammars.submit(spec))
            self.compiling.append(seq)
            return
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        """Queue ``seq``, or set it aside until its adapter is in host memory."""
        if self._adapter_ready(seq):
            self.waiting.append(seq)
        elif seq.status != SequenceStatus.FINISHED:
            self.loading.append(seq)

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter (if any) may be computed under now; one that could not be
        read fails ``seq`` (``failed``), which is then neither ready nor waiting."""
        if self.adapters is None or seq.lora_name is None:
            return True
        try:
            return self.adapters.ready(seq.lora_name)
        except ValueError as exc:
            self._finish(seq, FinishReason.ABORT)
            self.failed.append((seq, str(exc)))
            return False

    def _take_loaded(self) -> None:
        """Queue the sequences whose adapter is in host memory now, in the order they came."""
        loading, self.loading = self.loading, []
        for seq in loading:
            self._queue(seq)

    def drain_failed(self) -> list[tuple[Sequence, str]]:
        """The sequences given up since the last call, each with why (a grammar that could
        not be compiled, or that refuses the output the sequence came with; an adapter that
        could not be read again)."""
        failed, self.failed = self.failed, []
        return failed

    def _take_compiled(self) -> None:
        """Queue the sequences whose grammar has been compiled, their grammar started."""
        still: list[Sequence] = []
        for seq in self.compiling:
            grammar = seq.grammar
            assert grammar is not None
            if not grammar.compiled:
                still.append(seq)
                continue
            try:
                complete = grammar.start(seq.output_token_ids)
            except GrammarError as exc:
                self._finish(seq, FinishReason.ABORT)
                self.failed.append((seq, f"structured output: {exc}"))
                continue
            if complete:  # migrated with its answer already whole: nothing is left to sample
                self._finish(seq, FinishReason.STOP)
                self.failed.append((seq, "structured output: it was complete already"))
                continue
            self._queue(seq)
        self.compiling = still

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its pages; None if it is unknown."""
        for queue in (self.running, self.waiting, self.compiling, self.loading):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    if queue is self.running:
                        self.batch.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                    return seq
        for seq, restore in self.restoring:
            if seq.request_id == request_id:
                self.restoring.remove((seq, restore))
                self._abandon(seq, restore)
                self._finish(seq, FinishReason.ABORT, free_pages=False)
                return seq
        return None

    def sequences(self) -> Iterator[Sequence]:
        """Every sequence this scheduler holds, running, queued or set aside."""
        yield from self.running
        yield from self.waiting
        yield from self.compiling
        yield from self.loading
        yield from (seq for seq, _ in self.restoring)

    def holds(self, request_id: str) -> bool:
        return any(seq.request_id == request_id for seq in self.sequences())

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.compiling
            or self.loading
            or self.restoring
            or self._abandoned
        )

    # -- the step -------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSequence]:
        if self.compiling:
            self._take_compiled()
        if self.loading:
            self._take_loaded()
        if self.restoring or self._abandoned:
            self._take_restored()
        steady = self._steady_decodes()
        if steady is not None:
            return steady
        batch = self._schedule_anew()
        if not batch and (self.restoring or self._abandoned) and self.tiers is not None:
            # Nothing to run but pages on their way up: wait for them here, not in a spin.
            restores = [restore for _, restore in self.restoring] + self._abandoned
            self.tiers.wait(restores, _RESTORE_WAIT_S)
        running = self.running
        if len(batch) == len(running) and all(
            item.seq is seq
            and item.num_new_tokens == 1
            and item.will_sample
            and not item.num_draft_slots
            for item, seq in zip(batch, running, strict=True)
        ):
            self._decodes = DecodeStep(batch, self.batch)
            self._decodes_of = batch
        else:
            self._decodes = self._decodes_of = None
        return batch

    def _steady_decodes(self) -> list[ScheduledSequence] | None:
        """The usual step, decided without the full pass: the running sequences are those of the
        last step, in its order, each still decoding, and nothing else is asked (no proposals,
        no admission). Each gets one token again, and a page where its token starts a new one,
        unless the free pages are short (the full pass then preempts). What ``_schedule_anew``
        would decide, read off the persistent batch's rows; None where it is not that step."""
        return self._decodes_again(self._decodes, ahead=False)

    def schedule_ahead(self, batch: list[ScheduledSequence]) -> list[ScheduledSequence] | None:
        """The step after ``batch``, a step of decodes launched but whose tokens are not read
        yet: the same rows again, each one position on. None unless that is the step
        ``schedule`` would give once they are read, a stop aside: every running sequence
        decodes in ``batch``, in running order, with no speculation, nothing waiting for a
        seat, and no row ended by its length at ``batch``'s token (its next position may lie
        past the model's). Each row gets a page where its next position starts one, or None
        where the free pages are short (``schedule`` then preempts). Pages freed from here
        until the step is read are held back (``release_held_pages``)."""
        step = batch if isinstance(batch, DecodeStep) else None
        if step is None and batch is self._decodes_of:
            step = self._decodes  # scheduled anew, as every running sequence's decode
        ahead = self._decodes_again(step, ahead=True)
        if ahead is not None:
            self._holding_freed_pages = True
        return ahead

    def _decodes_again(self, batch: DecodeStep | None, ahead: bool) -> DecodeStep | None:
        """``batch``'s rows decoding again, in a new ``DecodeStep``, with a page for each row
        whose position starts one: the position after its computed tokens, or (``ahead``) the
        one after that, while ``batch``'s tokens are not read yet. None unless the rows are
        still ``batch``'s (none came or went: they are every running sequence, in running
        order), each one known token from its end (a decode), with no speculation, nothing
        waiting for a seat and pages enough; ahead, also none where a row ends by its length at
        the token not read yet. Decided on the rows' columns, not sequence by sequence."""
        rows = self.batch
        if (
            batch is None
            or not batch.current
            or not batch
            or len(batch) != len(self.running)
            or len(batch) > self.token_budget
            or self.speculator is not None
            or (self.waiting and len(self.running) < self.max_num_seqs)
            or not rows.decodes_everywhere()
            or (ahead and rows.ends_by_length_next())
        ):
            return None
        starting = rows.rows_starting_pages(int(ahead))
        if len(starting) > self.page_manager.num_free_pages:
            return None
        if starting:
            seqs = rows.seqs
            page_ids = self.page_manager.allocate(len(starting))
            for row, page_id in zip(starting, page_ids, strict=True):
                seqs[row].page_ids.append(page_id)
            rows.add_pages(starting, page_ids)
        return DecodeStep(batch, rows, lead=int(ahead))

    def release_held_pages(self) -> None:
        """No step launched ahead is in flight any more: the pages freed meanwhile are free."""
        self._holding_freed_pages = False
        for page_ids in self._held_pages:
            self.page_manager.free(page_ids)
        self._held_pages.clear()

    def _schedule_anew(self) -> list[ScheduledSequence]:
        """The step decided from the whole state: see the module's docstring."""
        budget = self.token_budget
        batch: list[ScheduledSequence] = []
        scheduled: set[int] = set()
        # Decodes before prefill chunks: a decoding sequence's latency is what users feel. Two
        # passes over the running list in its own order: nothing is sorted or rebuilt per step.
        decoding: list[Sequence] = []
        chunking: list[Sequence] = []
        for seq in self.running:
            is_decoding = len(seq.token_ids) - seq.num_computed_tokens == 1
            (decoding if is_decoding else chunking).append(seq)
        slots: dict[int, int] = {}
        # Proposals only in steps of decodes alone. A prefill chunk already makes its step
        # compute-bound, so every extra row would cost full price there; and leaving such steps
        # as they would be without speculation keeps every chunk's boundaries and neighbours,
        # so its rounding, and the tokens that follow, are what they would have been.
        admitting = bool(self.waiting) and len(self.running) < self.max_num_seqs
        if self.speculator is not None and decoding and not chunking and not admitting:
            planned = self.speculator.plan_slots(decoding, self.max_model_len)
            slots = {id(seq): n for seq, n in zip(decoding, planned, strict=True) if n}
        # Every decoding sequence waits for this step, so prompt tokens beside them are capped.
        cap = self.max_prefill_tokens_while_decoding
        prompt_budget = cap if decoding and cap is not None else budget
        held_for_waiting = self._room_for_short_prompts(chunking, prompt_budget)
        for seq in (*decoding, *chunking):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            left = seq.num_tokens - seq.num_computed_tokens
            if left == 1:
                num_new = 1
            else:
                num_new = min(left, max(0, min(budget, prompt_budget) - held_for_waiting))
            if num_new == 0:
                continue
            num_slots = min(slots.get(id(seq), 0), budget - num_new) if slots else 0
            # Most steps a decoding sequence's next token lands in a page it holds already.
            held = len(seq.page_ids) * self.page_size
            needs_pages = seq.num_computed_tokens + num_new + num_slots > held
            if needs_pages and not self._reserve_for_running(seq, num_new + num_slots, scheduled):
                continue
            if left == 1:  # a decode reaches the end of its known tokens, so it samples
                batch.append(ScheduledSequence(seq, 1, True, num_slots))
            else:
                batch.append(ScheduledSequence.of(seq, num_new, num_slots))
            scheduled.add(id(seq))
            budget -= num_new + num_slots
            if left != 1:
                prompt_budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A sequence whose prompt KV was shipped has one token left: it is a decode.
            decode_ready = seq.num_tokens - seq.num_computed_tokens == 1
            limit = budget if decode_ready else min(budget, prompt_budget)
            if limit == 0 or not self._adapter_fits(seq):
                break
            if self.tiers is not None and not seq.page_ids and self._restore_from_tiers(seq):
                self.waiting.popleft()  # aside until its pages land; the next one may go
                continue
            num_admitted = self._admit(seq, limit)
            if num_admitted is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            self.batch.add(seq)
            batch.append(ScheduledSequence.of(seq, num_admitted))
            budget -= num_admitted
            if not decode_ready:
                prompt_budget -= num_admitted
        return batch

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run beside the running sequences: its adapter is among theirs,
        or they leave a device slot free (``max_adapters``)."""
        if self.max_adapters is None or seq.lora_name is None:
            return True
        running = {s.lora_name for s in self.running if s.lora_name is not None}
        return seq.lora_name in running or len(running) < self.max_adapters

    def _room_for_short_prompts(self, chunking: list[Sequence], prompt_budget: int) -> int:
        """Prompt tokens the running prompts leave this step to the waiting ones at the head of
        the queue that are shorter than every running prompt's remainder (shortest first): a
        64-token chat queued behind an 1800-token document would otherwise wait for all of the
        document's chunks. A quarter of the budget stays with the running prompts, so a stream
        of short prompts cannot starve them."""
        if not chunking or not self.waiting:
            return 0
        shortest_running = min(seq.num_tokens - seq.num_computed_tokens for seq in chunking)
        room, seats = 0, self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            left = seq.num_tokens - seq.num_computed_tokens
            if left == 1:
                continue  # its prompt KV was shipped: a decode, outside the prompt budget
            if left >= shortest_running or seats == 0:
                break
            room += left
            seats -= 1
        return min(room, prompt_budget * 3 // 4)

    def postprocess(
        self, batch: list[ScheduledSequence], runs: Seq[list[SampledToken]]
    ) -> list[SequenceOutput]:
        """Advance each scheduled sequence and append the run of tokens sampled for each one
        that sampled (``runs`` in batch order: the next token, after any accepted proposals),
        up to the first token that stops it. Returns what each sampling sequence gained."""
        if isinstance(batch, DecodeStep):
            if batch.current:
                return self._postprocess_rows(batch, runs)
            return self._postprocess_decodes(batch, runs)
        sampled_runs = iter(runs)
        outputs = []
        page_size = self.page_size
        for item in batch:
            seq = item.seq
            num_new = item.num_new_tokens
            computed = seq.num_computed_tokens
            if computed < seq.num_prompt_tokens:
                prompt_left = seq.num_prompt_tokens - computed
                self.num_prompt_tokens_computed += min(num_new, prompt_left)
            # Each accepted proposal's KV was written by this step's forward; the last token of
            # the run has none yet.
            run = next(sampled_runs) if item.will_sample else []
            computed += num_new + max(0, len(run) - 1)
            seq.num_computed_tokens = computed
            if computed >= (len(seq.page_hashes) + 1) * page_size:
                self._cache_full_pages(seq)  # a page was completed
            if not item.will_sample:
                self._release_pages_behind_window(seq)
                continue
            reason = None
            for count, sample in enumerate(run, 1):
                seq.token_ids.append(sample.token_id)
                seq.samples.append(sample)
                reason = self._stop_reason(seq, sample.token_id)
                if reason is not None:
                    run = run[:count]
                    break
            leaves = self._after_sampling(seq, reason)
            if not leaves:
                self._release_pages_behind_window(seq)
            outputs.append(SequenceOutput(seq, list(run), leaves))
        assert next(sampled_runs, None) is None, "more sampled runs than sampling sequences"
        self._refresh_rows(batch)
        return outputs

    def _refresh_rows(self, batch: list[ScheduledSequence]) -> None:
        """Bring the persistent batch's rows of ``batch``'s sequences still running up to
        date, after a step that changed them one by one."""
        for item in batch:
            if item.seq.status is SequenceStatus.RUNNING:
                self.batch.refresh(item.seq)

    def _postprocess_rows(self, batch: DecodeStep, runs: Seq[list[SampledToken]]) -> DecodeOutputs:
        """``postprocess`` for a ``DecodeStep`` whose rows are still the batch's: every row
        decoded past its prompt and sampled one token (no proposals: there is no speculator).
        The tokens are appended and counted on every row at once (``PersistentBatch.advance``);
        only the rows whose stop may have come (a possible end of sequence, the length
        reached, a grammar, stop token ids) or that completed a page are visited, in row order,
        as ``postprocess`` would visit them (their pages are filed and freed in that order).
        Under a sliding window every row is visited, for the pages it leaves behind."""
        rows = self.batch
        advanced = rows.advance(list(map(_FIRST, runs)))
        rows_out = zip(advanced.seqs, runs, repeat(False))
        outputs = list(map(tuple.__new__, repeat(SequenceOutput), rows_out))
        check, filled = advanced.check, advanced.filled
        left: list[int] = []
        visit: Seq[int]
        if self.release_window is not None:
            visit = range(len(outputs))
        elif check is None:
            if filled is None:
                return DecodeOutputs(outputs, advanced.token_columns(left), left)
            visit = np.flatnonzero(filled).tolist()
        else:
            visit = np.flatnonzero(check if filled is None else check | filled).tolist()
        for row in visit:
            seq = advanced.seqs[row]
            if filled is not None and filled[row]:
                self._cache_full_pages(seq)  # a page was completed
                rows.note_hashed(row - len(left), len(seq.page_hashes))
            by_hand = check is not None and check[row]
            reason = self._stop_reason(seq, advanced.tokens[row]) if by_hand else None
            if reason is not None and self._after_sampling(seq, reason):
                outputs[row] = SequenceOutput(seq, runs[row], True)
                left.append(row)
            else:
                self._release_pages_behind_window(seq)
        return DecodeOutputs(outputs, advanced.token_columns(left), left)

    def _postprocess_decodes(
        self, batch: list[ScheduledSequence], runs: Seq[list[SampledToken]]
    ) -> list[SequenceOutput]:
        """``postprocess`` for a ``DecodeStep`` whose rows changed since it was made, one row at
        a time: a step launched ahead, after which a row's sequence left the batch (it stopped
        at the token before, or was aborted). Every row decoded past its prompt and sampled one
        token (no proposals: there is no speculator); the rows that left are dropped."""
        outputs = []
        page_size = self.page_size
        for item, run in zip(batch, runs, strict=True):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            computed = seq.num_computed_tokens + 1
            seq.num_computed_tokens = computed
            if computed >= (len(seq.page_hashes) + 1) * page_size:
                self._cache_full_pages(seq)  # a page was completed
            sample = run[0]
            seq.token_ids.append(sample.token_id)
            seq.samples.append(sample)
            reason = self._stop_reason(seq, sample.token_id)
            leaves = reason is not None and self._after_sampling(seq, reason)
            if not leaves:
                self._release_pages_behind_window(seq)
            outputs.append(SequenceOutput(seq, run, leaves))
        self._refresh_rows(batch)
        return outputs

    def _after_sampling(self, seq: Sequence, reason: FinishReason | None) -> bool:
        """Retire ``seq`` if its new tokens ended it; whether it left the batch."""
        if reason is None:
            return False
        self._stop_running(seq)
        self._finish(seq, reason)
        return True

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.batch.remove(seq)

    # -- helpers --------------------------------------------------------------------------------

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        total = ceil_div(seq.num_computed_tokens + num_new, self.page_size)
        return max(0, total - len(seq.page_ids))

    def _reserve_for_running(self, seq: Sequence, num_new: int, scheduled: set[int]) -> bool:
        """Give ``seq`` the pages its next ``num_new`` tokens need, preempting the newest
        unscheduled sequences for them; False if ``seq`` itself had to be preempted."""
        needed = self._pages_needed(seq, num_new)
        while needed > self.page_manager.num_free_pages:
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        seq.page_ids.extend(self.page_manager.allocate(needed))
        self.batch.refresh(seq)
        return True

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Take the cached prefix and first chunk's pages for a waiting sequence; returns the
        chunk's token count, or None (nothing taken) if the pages are not there."""
        if seq.page_ids:
            return self._admit_with_pages(seq, budget)
        # At least the last token is recomputed: its logits give the next token. A prompt
        # whose tokens are to be scored is computed whole.
        max_hit_pages = (seq.num_tokens - 1) // self.page_size
        if seq.num_prompt_logprobs_due:
            max_hit_pages = 0
        hits = self.page_manager.match_prefix(seq.token_ids, max_hit_pages, seq.cache_namespace)
        num_computed = len(hits) * self.page_size
        num_new = min(seq.num_tokens - num_computed, budget)
        total_pages = ceil_div(num_computed + num_new, self.page_size)
        reclaimed = sum(1 for b in hits if self.page_manager.ref_count(b) == 0)
        if total_pages - len(hits) > self.page_manager.num_free_pages - reclaimed:
            return None
        self.page_manager.acquire(hits)
        seq.page_ids = hits + self.page_manager.allocate(total_pages - len(hits))
        # The hits are filed pages: their hashes are the prompt's, computed once by match_prefix.
        seq.page_hashes = [self.page_manager.page_hash(b) for b in hits]
        seq.num_computed_tokens = num_computed
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = num_computed
        return num_new

    def _restore_from_tiers(self, seq: Sequence) -> bool:
        """Set ``seq`` aside with fresh pages for the pages of its prompt past the pool's prefix
        match that the tiers hold, and start their restore; False (nothing taken) where the
        tiers hold none of them or the pool lacks the pages."""
        tiers = self.tiers
        assert tiers is not None
        if seq.num_prompt_logprobs_due:
            return False  # scored prompts are computed whole
        max_hit_pages = (seq.num_tokens - 1) // self.page_size
        manager = self.page_manager
        hits = manager.match_prefix(seq.token_ids, max_hit_pages, seq.cache_namespace)
        if len(hits) >= max_hit_pages:
            return False
        parent = manager.page_hash(hits[-1]) if hits else None
        found = tiers.lookup(
            seq.token_ids,
            len(hits),
            parent,
            seq.cache_namespace,
            max_hit_pages,
            count_misses=not seq.tier_misses_counted,
        )
        seq.tier_misses_counted = True
        if not found:
            return False
        # Pages another sequence's restore is bringing up already are not copied twice: with
        # the first such page next, this one waits for that restore and finds them in the pool.
        in_flight = {
            page.key.page_hash: restore
            for _, restore in self.restoring
            if not restore.follows
            for page in restore.pages
        }
        busy = next((i for i, page in enumerate(found) if page.key.page_hash in in_flight), None)
        if busy == 0:
            self.restoring.append((seq, tiers.follow(in_flight[found[0].key.page_hash])))
            return True
        found = found[:busy]
        reclaimed = sum(1 for b in hits if manager.ref_count(b) == 0)
        if len(found) > manager.num_free_pages - reclaimed:
            return False
        restore = tiers.start_restore(found)  # before allocating: that may evict host pages
        manager.acquire(hits)
        pages = manager.allocate(len(found))
        tiers.submit(restore, pages)
        seq.page_ids = hits + pages
        seq.page_hashes = [manager.page_hash(b) for b in hits]
        seq.num_computed_tokens = len(hits) * self.page_size
        self.restoring.append((seq, restore))
        return True

    def _take_restored(self) -> None:
        """Queue again, at the head, each sequence whose restore is done: the pages that landed
        whole are filed in the prefix cache, and every page it took is given back, so that its
        admission finds them there as any prefix hit (those that did not land are computed).
        Given back, not held: a sequence waiting with pages could hold those that the one
        ahead of it needs. Then give back the pages of aborted sequences' done restores."""
        tiers = self.tiers
        assert tiers is not None
        manager = self.page_manager
        back: list[Sequence] = []
        still: list[tuple[Sequence, Restore]] = []
        for seq, restore in self.restoring:
            if not restore.done:
                still.append((seq, restore))
                continue
            landed = tiers.settle(restore)
            for page_id, page in zip(restore.pool_pages[:landed], restore.pages, strict=False):
                key = page.key
                manager.cache_page(page_id, key.page_hash, key.token_ids, key.parent)
            manager.free(seq.page_ids)
            seq.page_ids = []
            seq.page_hashes = []
            seq.num_computed_tokens = 0
            back.append(seq)
        self.restoring = still
        for seq in reversed(back):
            self.waiting.appendleft(seq)
        abandoned: list[Restore] = []
        for restore in self._abandoned:
            if restore.done:
                tiers.settle(restore)
                manager.free(restore.pool_pages)
            else:
                abandoned.append(restore)
        self._abandoned = abandoned

    def _abandon(self, seq: Sequence, restore: Restore) -> None:
        """``seq`` was aborted while its pages were on their way up: its pool hits go back now,
        the pages being written once the mover is done with them (``_take_restored``)."""
        assert restore.job is not None
        if restore.follows:
            return  # it holds no pages, and the restore it waits for is another's
        restore.job.cancelled = True
        num_hits = len(seq.page_ids) - len(restore.pool_pages)
        self.page_manager.free(seq.page_ids[:num_hits])
        seq.page_ids = []
        self._abandoned.append(restore)

    def _admit_with_pages(self, seq: Sequence, budget: int) -> int | None:
        """Admit a sequence whose leading KV already sits in its own pages (shipped from a
        prefill worker): file those pages in the prefix cache and take the next chunk's pages."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        needed = self._pages_needed(seq, num_new)
        if needed > self.page_manager.num_free_pages:
            return None
        seq.page_ids.extend(self.page_manager.allocate(needed))
        self._cache_full_pages(seq)
        return num_new

    def _cache_full_pages(self, seq: Sequence) -> None:
        """File every newly completed page of ``seq`` in the prefix cache."""
        start = len(seq.page_hashes) * self.page_size
        end = seq.num_computed_tokens // self.page_size * self.page_size
        if end <= start:
            return
        parent = seq.page_hashes[-1] if seq.page_hashes else None
        tokens = seq.token_ids[start:end]
        new_hashes = page_hashes(tokens, self.page_size, parent, seq.cache_namespace)
        for offset, page_hash in enumerate(new_hashes):
            index = len(seq.page_hashes)
            page_tokens = tokens[offset * self.page_size : (offset + 1) * self.page_size]
            self.page_manager.cache_page(seq.page_ids[index], page_hash, page_tokens, parent)
            seq.page_hashes.append(page_hash)
            parent = page_hash

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if seq.grammar is not None:
            try:
                if seq.grammar.advance(token_id):
                    return FinishReason.STOP  # its structured output is whole
            except GrammarError as exc:  # a token no mask allowed: never sampled under one
                self.failed.append((seq, str(exc)))
                return FinishReason.ABORT
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.LENGTH if num_tokens >= self.max_model_len else None

    def _release_pages_behind_window(self, seq: Sequence) -> None:
        """Give back the pages of ``seq`` that no later step reads. Every query from here on
        sits at ``num_computed_tokens`` or later (a decode, a chunk, proposals to verify, a step
        launched ahead alike) and reads back ``release_window`` positions, its own included, so
        a page whose positions all lie before the first of those is read no more. Filed in the
        prefix cache, it stays findable there until the pool reuses it."""
        window = self.release_window
        if window is None:
            return
        behind = max(0, seq.num_computed_tokens - window + 1) // self.page_size
        behind = min(behind, len(seq.page_ids))
        if behind <= seq.num_released_pages:
            return
        released = seq.page_ids[seq.num_released_pages : behind]
        seq.num_released_pages = behind
        self.num_released_pages += len(released)
        self._give_back(released)

    def _give_back(self, page_ids: list[int]) -> None:
        """Drop the sequence's reference on ``page_ids``, once no step in flight writes them."""
        if self._holding_freed_pages:
            self._held_pages.append(page_ids)
        else:
            self.page_manager.free(page_ids)

    def _free_pages(self, seq: Sequence) -> None:
        self._give_back(seq.held_page_ids)
        seq.page_ids = []
        seq.num_released_pages = 0

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        self._free_pages(seq)
        seq.page_hashes = []
        seq.num_computed_tokens = 0
        seq.speculation = SpeculationState()  # a draft model's KV went with the pages
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason | None, free_pages: bool = True) -> None:
        if free_pages:
            self._free_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


class PrefillScheduler(Scheduler):
    """The prefill worker's scheduler: a sequence leaves the batch once its first token is
    sampled and, unless that token ended it (``finish_reason`` set), keeps its pages for the
    transfer until the caller hands it to ``release``. It has nothing to speculate on, and is
    built with no ``release_window``: the decode worker receives every page of the prompt, and
    gives back those behind its window itself."""

    def release(self, seq: Sequence) -> None:
        """Free the pages a prefilled sequence still holds, once they are shipped."""
        self._free_pages(seq)

    def _after_sampling(self, seq: Sequence, reason: FinishReason | None) -> bool:
        self._stop_running(seq)
        self._finish(seq, reason, free_pages=reason is not None)
        return True


class DecodeScheduler(Scheduler):
    """The decode worker's scheduler. Besides requests it prefills itself, it takes prompts
    whose KV a prefill worker computed: their pages are reserved when the first news of them
    comes, written by transfers, and then either handed to the sequence with the prompt counted
    as computed, or given back."""

    def reserve(self, num_prompt_tokens: int) -> list[int] | None:
        """Pages for a prompt of ``num_prompt_tokens`` tokens; None if they are not free."""
        num_pages = ceil_div(num_prompt_tokens, self.page_size)
        if not 0 < num_pages <= self.page_manager.num_free_pages:
            return None
        return self.page_manager.allocate(num_pages)

    def drop_reservation(self, page_ids: list[int]) -> None:
        self.page_manager.free(page_ids)

    def admit_prefilled(self, seq: Sequence, page_ids: list[int]) -> None:
        """Queue ``seq`` with its prompt's KV already in ``page_ids``; the pages are given
        back, and ``ValueError`` raised, if the scheduler cannot take it."""
        seq.page_ids = page_ids
        seq.num_computed_tokens = seq.num_prompt_tokens
        try:
            self.add(seq)
        except ValueError:
            self._free_pages(seq)
            raise
