"""The running sequences as rows of arrays kept from step to step.

A decode step at batch 64 used to walk 64 ``Sequence`` objects five times over: to decide the
step, to build its inputs, to ask whether every row is a plain argmax, to append the sampled
tokens and check each stop condition, and to lay out the token columns sent to the router. Each
walk costs about a microsecond a row in Python. ``PersistentBatch`` keeps what those walks read
as NumPy columns, one row per running sequence in the scheduler's running order, and updates
them by what changed instead of reading them again every step:

- ``add`` (a sequence starts running: admitted, or back after a preemption) appends a row;
- ``remove`` (finished, preempted, aborted) deletes its row, the rows after it moving up, so the
  rows stay in running order (the forward's rows, and so its rounding, are what they were);
- ``refresh`` (a step that was not a plain decode step changed a sequence: a prompt chunk,
  accepted proposals, pages taken) reads one row again from its sequence;
- ``add_pages`` (decoding rows whose next position starts a page) writes their new page ids;
- ``advance`` (a plain decode step's tokens) writes every row at once: the tokens are appended
  to the sequences' own lists by C-level maps, the counts move on as array arithmetic, and the
  rows a stop condition or a completed page may concern are picked out for the scheduler.

The sequences remain the owners of every request's state: the rows mirror what a step reads
and writes (the newest token, how many tokens there are and how many are computed, the page
ids, and what the sampling parameters say about stopping and sampling), and ``advance`` writes
the sequences as it writes the rows. While a sequence runs, only the scheduler changes its
tokens, computed count and pages, and it tells the batch each time (``Scheduler`` keeps this
contract); ``columns_of`` rebuilds the rows from the sequences, which is what the tests hold
the kept rows to.

A step over every row, made while no row has come or gone since (``epoch``), is a
``DecodeStep``: the runner builds its forward inputs and its sampling metadata from the rows
(``forward_inputs``, ``all_plain_argmax``), and the scheduler's postprocess writes its tokens
through ``advance``, which also lays out the token columns the decode worker sends to the
router (``TokenColumns``). Any other step (prompt chunks, speculative verification, a step
after rows left) goes through the ``Sequence`` objects as before, and ``refresh`` brings the
rows it touched up to date.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter

import numpy as np
import torch

from common.engine.batch import (
    ForwardInputs,
    HostStaging,
    ScheduledSequence,
    SequenceOutput,
    decode_inputs,
)
from common.engine.sampler import SampledToken, plain_argmax
from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams

_FIRST = itemgetter(0)
_HANDOFF_WAIT = attrgetter("handoff_wait_s")

# The columns ``columns_of`` and ``columns`` give, each [rows] (the page table [rows, pages]).
COLUMNS = (
    "num_computed",
    "ahead",
    "start_base",
    "last_token",
    "stop_at",
    "by_hand",
    "checks_eos",
    "greedy_plain",
    "min_tokens",
    "num_hashed",
    "num_pages",
    "wants_logprobs",
)


class DecodeStep(list[ScheduledSequence]):
    """A step of plain decodes over every row of ``rows``, in row order, made at ``rows``'
    ``epoch``: each row feeds its newest token at position ``num_computed + lead`` (``lead``
    1 for a step launched ahead, whose tokens follow those of a step not read yet) and samples
    one token. It is a list of ``ScheduledSequence`` like any step, for whoever reads it so;
    the runner and the scheduler read the rows instead while it is ``current``."""

    __slots__ = ("epoch", "lead", "rows")

    def __init__(self, items: Iterable[ScheduledSequence], rows: PersistentBatch, lead: int = 0):
        super().__init__(items)
        self.rows = rows
        self.epoch = rows.epoch
        self.lead = lead

    @property
    def current(self) -> bool:
        """Whether the rows are still the step's: no row came or went since it was made."""
        return self.epoch == self.rows.epoch


@dataclass(slots=True)
class Advanced:
    """What ``PersistentBatch.advance`` leaves to the scheduler, each column [rows] in the
    step's row order: ``check``, the rows whose stop it must check by hand (a token that may
    end the sequence, its length reached, a grammar or stop token ids); ``filled``, the rows
    whose newest computed position completed a page (to file in the prefix cache);
    ``says_more``, the rows whose delta is more than its token (a logprob, a first output
    token)."""

    seqs: list[Sequence]  # the step's rows, as they were before any left
    request_ids: list[str]
    tokens: list[int]
    starts: list[int]  # each row's output index of its new token
    check: np.ndarray | None  # None: no row
    filled: np.ndarray | None
    says_more: np.ndarray | None

    def token_columns(self, left: list[int]) -> TokenColumns:
        """The step's token columns, given the rows that left the batch (finished)."""
        starts = self.starts
        handoffs = any(map(_HANDOFF_WAIT, self.seqs))  # stage times to report after a handoff
        if not left and self.says_more is None and not handoffs:
            return TokenColumns(self.request_ids, self.tokens, starts, [])
        n = len(self.seqs)
        full = np.zeros(n, bool) if self.says_more is None else self.says_more.copy()
        full[left] = True
        if handoffs:
            full |= np.array([seq.handoff_wait_s is not None for seq in self.seqs], bool)
        full_rows = np.flatnonzero(full).tolist()
        kept = np.flatnonzero(~full).tolist()
        return TokenColumns(
            [self.request_ids[i] for i in kept],
            [self.tokens[i] for i in kept],
            [starts[i] for i in kept],
            full_rows,
        )


class DecodeOutputs(list[SequenceOutput]):
    """``Scheduler.postprocess``'s outputs for a ``DecodeStep``, one per row in row order, with
    the step's token columns (``columns``): a decode worker sends those as they are."""

    __slots__ = ("columns", "left")

    def __init__(
        self, outputs: Iterable[SequenceOutput], columns: TokenColumns, left: list[int]
    ) -> None:
        super().__init__(outputs)
        self.columns = columns
        self.left = left  # the rows (indices into the outputs) that left the batch


@dataclass(slots=True)
class TokenColumns:
    """A plain decode step's new tokens as the columns of ``TokenDeltas`` (common/protocol.py),
    one entry per row whose delta is its token alone, in row order; ``full_rows``: the rows
    (indices into the step's outputs) whose delta says more (a finish, a logprob, a first
    output token, stage times)."""

    request_ids: list[str]
    token_ids: list[int]
    start_indices: list[int]
    full_rows: list[int]


class PersistentBatch:
    """See the module's docstring. ``page_size`` and ``max_model_len`` are the engine's;
    ``eos_token_ids`` the model's.

    Beside the columns it keeps a few facts about all rows at once, so that a step over a few
    rows does not pay for array operations that find nothing: how many steps until the first
    row reaches its length, completes a page, or needs a new one (each counted down by
    ``advance`` and worked out again from the columns when unknown or run out), how many rows
    stop by hand, check for an end of sequence or report logprobs, and whether every row is a
    decode and a plain argmax."""

    def __init__(self, page_size: int, max_model_len: int, eos_token_ids: Iterable[int]) -> None:
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = np.array(sorted(set(eos_token_ids)), np.int64)
        self._eos = frozenset(eos_token_ids)
        self.epoch = 0  # moves on at every add and remove
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []
        self.lora_names: list[str | None] = []
        self.num_loras = 0  # rows under an adapter
        # Each row's own ``token_ids`` and ``samples`` lists: ``advance`` appends to them.
        self._token_lists: list[list[int]] = []
        self._sample_lists: list[list[SampledToken]] = []
        capacity = 8
        # A plain decode step moves every row's token count, computed count and output count
        # on by one: only the computed count is kept as it is, the others as differences a
        # decode step leaves as they are (one array operation a step instead of three).
        self.num_computed = np.zeros(capacity, np.int64)  # seq.num_computed_tokens
        self.ahead = np.zeros(capacity, np.int64)  # len(seq.token_ids) - num_computed: 1, decoding
        # num_computed - seq.num_output_tokens + 1: a decode step's new token's output index is
        # its new computed count less this.
        self.start_base = np.zeros(capacity, np.int64)
        self.last_token = np.zeros(capacity, np.int64)  # seq.token_ids[-1]
        # The computed count at which the row stops by length (max_tokens or the model's).
        self.stop_at = np.zeros(capacity, np.int64)
        # Whether its stop needs the sequence itself after each token: a grammar to advance, or
        # stop token ids.
        self.by_hand = np.zeros(capacity, bool)
        self.checks_eos = np.zeros(capacity, bool)  # not params.ignore_eos
        # Whether its params alone make its next token a plain argmax (``plain_argmax``), once
        # it has ``min_tokens`` output tokens.
        self.greedy_plain = np.zeros(capacity, bool)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.num_hashed = np.zeros(capacity, np.int64)  # len(seq.page_hashes): full pages filed
        self.num_pages = np.zeros(capacity, np.int64)  # len(seq.page_ids)
        self.wants_logprobs = np.zeros(capacity, bool)  # params.logprobs is not None
        self.page_table = np.zeros((capacity, 4), np.int32)  # zeros past each row's pages
        # Counts over the rows, kept by add and remove.
        self._num_by_hand = 0
        self._num_eos = 0
        self._num_logprobs = 0
        # Steps before the first row reaches its length, completes a page, starts a page it
        # does not hold (None: to be worked out from the columns).
        self._length_room: int | None = None
        self._fill_room: int | None = None
        self._page_room: int | None = None
        self._all_decoding: bool | None = None  # None: to be worked out
        self._all_plain = False  # known true (it then stays true as outputs grow)
        self._any_fresh = False  # a row may have no output token yet
        self._width: int | None = None  # the most pages a row holds (None: to be worked out)
        self._aranges: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    # -- events ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """``seq`` starts running: a row at the end."""
        row = len(self.seqs)
        if row == len(self.num_computed):
            self._grow_rows(2 * row)
        self.seqs.append(seq)
        self.request_ids.append(seq.request_id)
        self.lora_names.append(seq.lora_name)
        self.num_loras += seq.lora_name is not None
        self._token_lists.append(seq.token_ids)
        self._sample_lists.append(seq.samples)
        params = seq.params
        by_hand = seq.grammar is not None or bool(params.stop_token_ids)
        self.by_hand[row] = by_hand
        self._num_by_hand += by_hand
        self.checks_eos[row] = not params.ignore_eos
        self._num_eos += not params.ignore_eos
        self.greedy_plain[row] = _greedy_plain(params)
        self.min_tokens[row] = params.min_tokens
        self.wants_logprobs[row] = params.logprobs is not None
        self._num_logprobs += params.logprobs is not None
        self._read(row, seq)
        self.epoch += 1

    def remove(self, seq: Sequence) -> None:
        """``seq`` stops running (finished, preempted, aborted): its row goes, the rows after it
        move up one."""
        row = self.seqs.index(seq)
        n = len(self.seqs)
        self._num_by_hand -= bool(self.by_hand[row])
        self._num_eos -= bool(self.checks_eos[row])
        self._num_logprobs -= bool(self.wants_logprobs[row])
        for column in self._arrays():
            column[row : n - 1] = column[row + 1 : n]
        for names in (self.seqs, self.request_ids, self._token_lists, self._sample_lists):
            del names[row]
        self.num_loras -= self.lora_names.pop(row) is not None
        self._forget_facts()
        self.epoch += 1

    def refresh(self, seq: Sequence) -> None:
        """Read ``seq``'s row again: a step that was not a plain decode step changed it."""
        self._read(self.seqs.index(seq), seq)

    def add_pages(self, rows: list[int], page_ids: list[int]) -> None:
        """Each of ``rows`` (distinct) took the page of ``page_ids`` beside it at the end of its
        pages."""
        if not rows:
            return
        held = self.num_pages[rows]
        width = int(held.max()) + 1
        if width > self.page_table.shape[1]:
            self._grow_pages(max(width, 2 * self.page_table.shape[1]))
        self.page_table[rows, held] = page_ids
        self.num_pages[rows] = held + 1
        self._page_room = None
        if self._width is not None:
            self._width = max(self._width, width)

    def advance(self, samples: list[SampledToken]) -> Advanced:
        """A plain decode step over every row sampled ``samples`` (one per row, in row order):
        append each to its sequence and count its position as computed, there and in the
        rows. What the scheduler still has to do by hand comes back (``Advanced``)."""
        n = len(self.seqs)
        tokens = list(map(_FIRST, samples))
        deque(map(list.append, self._token_lists, tokens), maxlen=0)
        deque(map(list.append, self._sample_lists, samples), maxlen=0)
        self.last_token[:n] = tokens
        computed = self.num_computed[:n]
        computed += 1
        deque(map(setattr, self.seqs, repeat("num_computed_tokens"), computed.tolist()), maxlen=0)
        starts = (computed - self.start_base[:n]).tolist()
        # The rows whose stop is checked by hand: those that may have stopped.
        check = self.by_hand[:n].copy() if self._num_by_hand else None
        self._length_room = self._room(self._length_room, self._steps_to_length)
        if self._length_room <= 0:
            check = _either(check, computed >= self.stop_at[:n])
        if self._num_eos and not self._eos.isdisjoint(tokens):
            check = _either(check, np.isin(self.last_token[:n], self.eos_token_ids))
        filled = None
        self._fill_room = self._room(self._fill_room, self._steps_to_fill)
        if self._fill_room <= 0:
            filled = computed >= (self.num_hashed[:n] + 1) * self.page_size
        if self._page_room is not None:
            self._page_room -= 1
        says_more = None
        if self._num_logprobs or self._any_fresh:
            says_more = self.wants_logprobs[:n] | (computed == self.start_base[:n])
        self._any_fresh = False
        return Advanced(
            list(self.seqs), list(self.request_ids), tokens, starts, check, filled, says_more
        )

    def note_hashed(self, row: int, num_hashed: int) -> None:
        """Row ``row``'s sequence has ``num_hashed`` full pages filed in the prefix cache."""
        self.num_hashed[row] = num_hashed
        self._fill_room = None

    # -- what a step reads ----------------------------------------------------------------------

    def decodes_everywhere(self) -> bool:
        """Whether every row is one known token from its end: a decode (a plain decode step
        leaves every row so)."""
        if self._all_decoding is None:
            n = len(self.seqs)
            self._all_decoding = bool((self.ahead[:n] == 1).all())
        return self._all_decoding

    def rows_starting_pages(self, lead: int) -> list[int]:
        """The rows whose position ``num_computed + lead`` starts a page they do not hold."""
        n = len(self.seqs)
        if self._page_room is None:
            room = self.num_pages[:n] * self.page_size - self.num_computed[:n]
            self._page_room = int(room.min()) if n else 1 << 30
        if self._page_room > lead:
            return []
        room = self.num_pages[:n] * self.page_size - self.num_computed[:n]
        return np.flatnonzero(room <= lead).tolist()

    def ends_by_length_next(self) -> bool:
        """Whether a row ends by its length at its next token, one past its newest: a step
        launched ahead of it would compute a position it may not have."""
        room = self._length_room
        return (room if room is not None else self._steps_to_length()) <= 1

    def all_plain_argmax(self) -> bool:
        """Whether every row's next token is its logits' argmax with nothing else asked
        (``plain_argmax``, read off the rows)."""
        if not self._all_plain:
            n = len(self.seqs)
            num_output = self.num_computed[:n] - self.start_base[:n] + 1
            plain = self.greedy_plain[:n] & (num_output >= self.min_tokens[:n])
            self._all_plain = bool(plain.all())
        return self._all_plain

    def forward_inputs(
        self, device: torch.device, staging: HostStaging | None, lead: int = 0
    ) -> ForwardInputs:
        """A ``DecodeStep``'s forward inputs, read off the rows: each row feeds its newest
        token at position ``num_computed + lead`` and wants its logits (``flatten_decodes``
        gives the same from the sequences). With ``lead`` 1 the input ids are zeros, to be
        replaced by the tokens of the step launched before, on the device."""
        n = len(self.seqs)
        positions = self.num_computed[:n] + lead
        input_ids = self.last_token[:n].copy() if lead == 0 else np.zeros(n, np.int64)
        if self._width is None:
            self._width = int(self.num_pages[:n].max()) if n else 0
        width = self._width
        # A copy: the step's tables are its own, whatever later steps write into the rows.
        tables = self.page_table[:n, :width].copy()
        rows, query_start_loc = self._ranges(n)
        return decode_inputs(
            input_ids, positions, tables, rows, query_start_loc, self.page_size, device, staging
        )

    # -- checking -------------------------------------------------------------------------------

    def columns(self) -> dict[str, list]:
        """The kept rows, column by column (``COLUMNS``, then the page table, request ids and
        adapters), as lists: what ``columns_of`` gives for the same sequences."""
        n = len(self.seqs)
        out: dict[str, list] = {name: getattr(self, name)[:n].tolist() for name in COLUMNS}
        out["num_tokens"] = (self.num_computed[:n] + self.ahead[:n]).tolist()
        out["num_output"] = (self.num_computed[:n] - self.start_base[:n] + 1).tolist()
        out["page_table"] = [
            self.page_table[row, : self.num_pages[row]].tolist() for row in range(n)
        ]
        out["request_ids"] = list(self.request_ids)
        out["lora_names"] = list(self.lora_names)
        return out

    @classmethod
    def columns_of(
        cls,
        seqs: Seq[Sequence],
        page_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
    ) -> dict[str, list]:
        """The rows a batch built afresh from ``seqs`` holds: the reference the kept rows are
        held to."""
        batch = cls(page_size, max_model_len, eos_token_ids)
        for seq in seqs:
            batch.add(seq)
        return batch.columns()

    # -- internals ------------------------------------------------------------------------------

    def _read(self, row: int, seq: Sequence) -> None:
        """The per-step columns of ``row`` from ``seq``."""
        tokens = seq.token_ids
        computed = seq.num_computed_tokens
        self.num_computed[row] = computed
        self.ahead[row] = len(tokens) - computed
        self.start_base[row] = computed - (len(tokens) - seq.num_prompt_tokens) + 1
        self.last_token[row] = tokens[-1]
        stop_length = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        self.stop_at[row] = stop_length - (len(tokens) - computed)
        self.num_hashed[row] = len(seq.page_hashes)
        pages = seq.page_ids
        num_pages = len(pages)
        if num_pages > self.page_table.shape[1]:
            self._grow_pages(max(num_pages, 2 * self.page_table.shape[1]))
        self.page_table[row, :num_pages] = pages
        self.page_table[row, num_pages:] = 0
        self.num_pages[row] = num_pages
        self._forget_facts()
        self._any_fresh |= len(tokens) == seq.num_prompt_tokens

    def _ranges(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``arange(n)`` and ``arange(n + 1)`` in int32, made once per batch size: a decode
        step's logits indices and query starts (never written, on the host or off it)."""
        ranges = self._aranges.get(n)
        if ranges is None:
            ranges = self._aranges[n] = (np.arange(n), np.arange(n + 1, dtype=np.int32))
        return ranges

    def _forget_facts(self) -> None:
        """A row came, went or was read again: what was known of all rows is worked out anew."""
        self._length_room = self._fill_room = self._page_room = self._width = None
        self._all_decoding = None
        self._all_plain = False

    def _room(self, room: int | None, steps: Callable[[], int]) -> int:
        """A countdown after a step: one less than ``room``, or ``steps()`` when unknown or run
        out (a row that reached the mark may not have left)."""
        if room is None or room <= 1:
            return steps()
        return room - 1

    def _steps_to_length(self) -> int:
        """Tokens until the first row reaches its length (0: one has)."""
        n = len(self.seqs)
        return int((self.stop_at[:n] - self.num_computed[:n]).min()) if n else 1 << 30

    def _steps_to_fill(self) -> int:
        """Computed positions until the first row completes a page it has not filed (0: one
        has)."""
        n = len(self.seqs)
        if not n:
            return 1 << 30
        return int(((self.num_hashed[:n] + 1) * self.page_size - self.num_computed[:n]).min())

    def _arrays(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in COLUMNS] + [self.page_table]

    def _grow_rows(self, capacity: int) -> None:
        for name in (*COLUMNS, "page_table"):
            old = getattr(self, name)
            grown = np.zeros((capacity, *old.shape[1:]), old.dtype)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def _grow_pages(self, width: int) -> None:
        rows, old_width = self.page_table.shape
        grown = np.zeros((rows, width), np.int32)
        grown[:, :old_width] = self.page_table
        self.page_table = grown


def _either(mask: np.ndarray | None, more: np.ndarray) -> np.ndarray:
    return more if mask is None else mask | more


def _greedy_plain(params: SamplingParams) -> bool:
    """Whether ``params`` make every token past ``min_tokens`` a plain argmax."""
    return plain_argmax(params, max(params.min_tokens, 0))
