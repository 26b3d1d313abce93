"""The types one step passes along, and how its token runs become a forward's inputs.

The scheduler decides a step as ``ScheduledSequence``s; the runner turns them into
``TokenRun``s and flattens those into ``ForwardInputs`` (token ids, positions and the explicit
attention metadata of ``kernels/interface.py``); the scheduler's postprocess reports what each
sampling sequence gained as ``SequenceOutput``s. The runner, the CUDA graphs, the speculator and
the draft model all speak these types, so they live here, below all of them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from common.engine.sampler import SampledToken
from common.engine.sequence import Sequence
from kernels.interface import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    will_sample: bool  # this step reaches the end of the sequence's known tokens, so it samples
    num_draft_slots: int = 0  # proposed tokens this step may verify after its known ones

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, num_draft_slots: int = 0) -> ScheduledSequence:
        reaches_end = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        return cls(seq, num_new_tokens, reaches_end, num_draft_slots)


class SequenceOutput(NamedTuple):
    """What one step appended to one sampling sequence. A tuple, as ``SampledToken`` is: a step
    of plain decodes makes one per row with the tuple type's constructor, in C
    (``Scheduler.postprocess``)."""

    seq: Sequence
    new_samples: list[SampledToken]  # in order; several when proposed tokens were accepted
    left_batch: bool  # finished, or (prefill) handed over after its first token


@dataclass(frozen=True, slots=True)
class TokenRun:
    """The tokens one sequence feeds a forward: their ids, the position of the first, the
    sequence's pages, and how many of the last positions want logits."""

    token_ids: Seq[int]
    start: int
    page_ids: Seq[int]
    num_logits: int
    lora_name: str | None = None  # the LoRA adapter it computes under; None: the base model


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [M]


def flatten_runs(
    runs: Seq[TokenRun],
    page_size: int,
    device: torch.device,
    staging: HostStaging | None = None,
    page_tables: PageTables | None = None,
) -> ForwardInputs:
    """Flatten runs into token ids, positions and explicit attention metadata: one pass over
    the runs' Python lists into NumPy (``torch.tensor`` of a list costs tens of microseconds
    even for a few ids), a handful of array ops for every token at once, then one copy to the
    device (through ``staging``'s pinned buffer on CUDA). The page tables come from
    ``page_tables``, which keeps each sequence's pages as a row from step to step."""
    num_runs = len(runs)
    query_lens = np.fromiter((len(run.token_ids) for run in runs), np.int64, num_runs)
    starts = np.fromiter((run.start for run in runs), np.int64, num_runs)
    num_logits = np.fromiter((run.num_logits for run in runs), np.int64, num_runs)
    num_tokens = int(query_lens.sum())
    input_ids = np.fromiter(chain.from_iterable(run.token_ids for run in runs), np.int64)
    tables = (page_tables or PageTables()).gather([run.page_ids for run in runs])
    ends = np.cumsum(query_lens)
    query_start_loc = np.concatenate(([0], ends))
    # Each token's run, then its position: its offset in the run plus the run's first position.
    owner = np.repeat(np.arange(num_runs), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[:-1][owner] + starts[owner]
    slots = page_slots(tables[owner, positions // page_size], positions, page_size)
    # Each run's last num_logits positions: its end minus (num_logits .. 1).
    logit_owner = np.repeat(np.arange(num_runs), num_logits)
    logits_before = np.concatenate(([0], np.cumsum(num_logits)[:-1]))
    logits_indices = (
        ends[logit_owner]
        - num_logits[logit_owner]
        + np.arange(int(num_logits.sum()))
        - logits_before[logit_owner]
    )
    return to_device(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=starts + query_lens,
        page_tables=tables,
        slots=slots,
        logits_indices=logits_indices,
        max_query_len=int(query_lens.max()),
        device=device,
        staging=staging,
    )


def flatten_decodes(
    seqs: Seq[Sequence],
    page_size: int,
    device: torch.device,
    staging: HostStaging | None = None,
    page_tables: PageTables | None = None,
    after: torch.Tensor | None = None,
) -> ForwardInputs:
    """``flatten_runs`` for a step of decodes alone, the usual step: each sequence feeds its
    newest token, at the position after its computed ones, and wants its logits. Built from the
    sequences themselves, with no ``TokenRun`` per sequence and none of the ragged arithmetic
    (a tenth of ``flatten_runs``' time at batch 64).

    ``after``: the token ids [len(seqs)], on the device, of a step launched over the same
    sequences whose tokens are not read yet. This step feeds those, one position further on
    (the engine's step ahead)."""
    num_seqs = len(seqs)
    positions = np.fromiter(map(_NUM_COMPUTED, seqs), np.int64, num_seqs)
    if after is None:
        input_ids = np.fromiter([seq.token_ids[-1] for seq in seqs], np.int64, num_seqs)
    else:
        input_ids = np.zeros(num_seqs, np.int64)  # replaced by ``after`` once on the device
        positions += 1
    tables = (page_tables or PageTables()).gather(list(map(_PAGE_IDS, seqs)))
    rows = np.arange(num_seqs)
    query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    inputs = decode_inputs(
        input_ids, positions, tables, rows, query_start_loc, page_size, device, staging
    )
    return inputs if after is None else dataclasses.replace(inputs, input_ids=after)


def decode_inputs(
    input_ids: np.ndarray,
    positions: np.ndarray,
    tables: np.ndarray,
    rows: np.ndarray,
    query_start_loc: np.ndarray,
    page_size: int,
    device: torch.device,
    staging: HostStaging | None,
) -> ForwardInputs:
    """The forward inputs of a step of decodes: row ``i`` feeds ``input_ids[i]`` at
    ``positions[i]`` over page-table row ``tables[i]`` and wants its logits (``rows``: 0..n-1,
    ``query_start_loc``: 0..n, which callers may keep between steps)."""
    slots = page_slots(tables[rows, positions // page_size], positions, page_size)
    return to_device(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=np.add(positions, 1, dtype=np.int32, casting="unsafe"),
        page_tables=tables,
        slots=slots,
        logits_indices=rows,
        max_query_len=1,
        device=device,
        staging=staging,
    )


# What a step of decodes reads of each sequence, as C-level getters (a generator over 64
# sequences costs twice as much).
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_PAGE_IDS = operator.attrgetter("page_ids")


def page_slots(pages: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """The KV slot of each position, given the page it falls in: ``page * page_size +
    position % page_size``, in int64 (a table holds int32 page ids)."""
    return pages.astype(np.int64) * page_size + positions % page_size


def to_device(
    *,
    input_ids: np.ndarray,
    positions: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    page_tables: np.ndarray,
    slots: np.ndarray,
    logits_indices: np.ndarray,
    max_query_len: int,
    device: torch.device,
    staging: HostStaging | None,
) -> ForwardInputs:
    # The backends take int32 offsets, lengths and tables (kernels/interface.py): converted
    # here, so the device gets them as they are, with no conversion launched there.
    ids, pos, qsl, lens, tables, slot_mapping, logits_at = (staging or HostStaging()).to_device(
        [
            input_ids,
            positions,
            query_start_loc.astype(np.int32, copy=False),
            seq_lens.astype(np.int32, copy=False),
            page_tables,
            slots,
            logits_indices,
        ],
        device,
    )
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=lens,
        page_tables=tables,
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
    )
    return ForwardInputs(ids, pos, meta, logits_at)


class PageTables:
    """Each sequence's page ids as a row of one int32 table kept from step to step: a step's
    page tables are a gather of its sequences' rows instead of a pass over every page id of the
    batch (5,000 ids at batch 64 with 1k tokens each: ~0.1 ms a step in Python).

    A sequence's page list is only ever extended or replaced (the scheduler's and the handoffs'
    contract), so a row belongs to the list object itself and stays good while that very list
    keeps its length; a list that grew writes only its new tail. Rows not asked for in a step
    are given back. Past a list's length the row it is gathered from holds zeros, so a step's
    tables, padded to its longest list, are what a fresh table would be."""

    def __init__(self) -> None:
        self._table = np.zeros((0, 0), np.int32)
        self._free_rows: list[int] = []
        # id(list) -> (the list, its row, how many of its pages the row holds). The entry keeps
        # the list alive, so its id cannot stand for another list meanwhile.
        self._rows: dict[int, tuple[Seq[int], int, int]] = {}
        # The last step's lists in its order, their rows and their lengths: the usual step asks
        # for the very same lists again, some of them one page longer.
        self._last_lists: list[Seq[int]] = []
        self._last_rows = np.zeros(0, np.intp)
        self._last_lengths: list[int] = []

    def gather(self, page_lists: Seq[Seq[int]]) -> np.ndarray:
        """The step's page tables: [len(page_lists), longest list], zero-padded."""
        lengths = list(map(len, page_lists))
        last = self._last_lists
        if len(page_lists) == len(last) and all(map(operator.is_, page_lists, last)):
            return self._gather_again(lengths)
        tables = self._gather_anew(page_lists)
        self._last_lists = list(page_lists)
        self._last_lengths = lengths
        return tables

    def _gather_again(self, lengths: list[int]) -> np.ndarray:
        """``gather`` for the last step's lists in the same order: only the lists that grew write
        their new pages (their rows already hold every other page id)."""
        width = max(lengths, default=0)
        if width > self._table.shape[1]:
            self._grow(self._table.shape[0], max(width, 2 * self._table.shape[1]))
        if lengths != self._last_lengths:
            for i, (now, held) in enumerate(zip(lengths, self._last_lengths, strict=True)):
                if now == held:
                    continue
                pages, row = self._last_lists[i], int(self._last_rows[i])
                if now > held:
                    self._table[row, held:now] = pages[held:]
                else:  # cleared and given fewer pages: the whole row again
                    self._table[row, :now] = pages
                    self._table[row, now:] = 0
                self._rows[id(pages)] = (pages, row, now)
            self._last_lengths = lengths
        return self._table[self._last_rows, :width]

    def _gather_anew(self, page_lists: Seq[Seq[int]]) -> np.ndarray:
        """``gather`` for any lists: rows found by each list's identity (kept as the rows of the
        next step's ``_gather_again``)."""
        rows = self._rows
        kept: dict[int, tuple[Seq[int], int, int]] = {}
        width = max(map(len, page_lists), default=0)
        if width > self._table.shape[1]:
            self._grow(self._table.shape[0], max(width, 2 * self._table.shape[1]))
        indices = []
        for pages in page_lists:
            num_pages = len(pages)
            entry = rows.get(id(pages))
            if entry is not None and entry[2] <= num_pages:
                row, held = entry[1], entry[2]
                if held < num_pages:
                    self._table[row, held:num_pages] = pages[held:]
            elif id(pages) in kept:  # the same list twice in one step
                row = kept[id(pages)][1]
            else:
                row = entry[1] if entry is not None else self._take_row()
                self._table[row, :num_pages] = pages
                self._table[row, num_pages:] = 0  # a reused row's or a shrunk list's old pages
            kept[id(pages)] = (pages, row, num_pages)
            indices.append(row)
        for key, (_, row, _) in rows.items():
            if key not in kept:
                self._free_rows.append(row)  # cleared past its new list when taken again
        self._rows = kept
        # An index array: it indexes the table 3x faster than a list.
        self._last_rows = np.array(indices, np.intp)
        return self._table[self._last_rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            num_rows = self._table.shape[0]
            self._grow(max(8, 2 * num_rows), self._table.shape[1])
            self._free_rows = list(range(self._table.shape[0] - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, num_rows: int, width: int) -> None:
        rows, old_width = self._table.shape
        grown = np.zeros((num_rows, width), np.int32)
        grown[:rows, :old_width] = self._table
        self._table = grown


# Triton compiles a kernel once per "specialisation" of its arguments, and a pointer's is
# whether it is a multiple of 16 bytes. Views of the staged buffer at offsets of only 8 would
# make a step's tables land on either side of that by the sizes of the arrays before them, and
# each new pattern compiled the kernels that read them again, seconds in front of a request.
STAGED_ALIGNMENT = 16


class HostStaging:
    """Moves a step's arrays to the device in one copy: on CUDA their bytes are packed into a
    pinned buffer (two, used in turn, so a step's copy never races the next step's packing),
    each at a 16-byte aligned offset (``STAGED_ALIGNMENT``), sent with one non-blocking
    host-to-device copy and viewed there in each array's dtype and shape; on the CPU they are
    wrapped, not copied. (A pinned buffer is freed only once the copies from it are done:
    torch's host allocator records them.)"""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def to_device(self, arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
        if device.type != "cuda":
            return [torch.from_numpy(array) for array in arrays]
        return self.through_one_buffer(arrays, device, pinned=True)

    def through_one_buffer(
        self, arrays: list[np.ndarray], device: torch.device, pinned: bool
    ) -> list[torch.Tensor]:
        """The CUDA path: ``arrays`` packed into one host buffer and copied to ``device`` in
        one go (the CPU is a ``device`` here only for tests, which cannot pin memory)."""
        flat = [np.ascontiguousarray(array).reshape(-1).view(np.uint8) for array in arrays]
        offsets, end = [], 0
        for raw in flat:
            offsets.append(end)
            end += -(-raw.size // STAGED_ALIGNMENT) * STAGED_ALIGNMENT
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].numel() < end:
            capacity = max(end, 1 << 17) * 2
            buffers = [torch.empty(capacity, dtype=torch.uint8) for _ in "ab"]
            self._buffers = [b.pin_memory() for b in buffers] if pinned else buffers
        host = self._buffers[self._turn]
        staged = host.numpy()
        for raw, offset in zip(flat, offsets, strict=True):
            staged[offset : offset + raw.size] = raw
        packed = host[:end].to(device, non_blocking=True)
        return [
            packed[offset : offset + raw.size].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
            for array, raw, offset in zip(arrays, flat, offsets, strict=True)
        ]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
