"""The types one step passes along, and how its token runs become a forward's inputs.

The scheduler decides a step as ``ScheduledSequence``s; the runner turns them into
``TokenRun``s and flattens those into ``ForwardInputs`` (token ids, positions and the explicit
attention metadata of ``kernels/interface.py``); the scheduler's postprocess reports what each
sampling sequence gained as ``SequenceOutput``s. The runner, the CUDA graphs, the speculator and
the draft model all speak these types, so they live here, below all of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from common.engine.sampler import SampledToken
from common.engine.sequence import Sequence
from kernels.interface import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    samples: bool  # this step reaches the end of the sequence's known tokens, so it samples
    num_draft_slots: int = 0  # proposed tokens this step may verify after its known ones

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, num_draft_slots: int = 0) -> ScheduledSequence:
        reaches_end = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        return cls(seq, num_new_tokens, reaches_end, num_draft_slots)


@dataclass(slots=True)
class SequenceOutput:
    """What one step appended to one sampling sequence."""

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


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [M]


def flatten_runs(runs: Seq[TokenRun], page_size: int, device: torch.device) -> ForwardInputs:
    """Flatten runs into token ids, positions and explicit attention metadata: Python per run,
    then a handful of tensor ops for every token at once."""
    input_ids: list[int] = []
    query_lens: list[int] = []
    starts: list[int] = []
    logits_indices: list[int] = []
    num_tokens = 0
    for run in runs:
        input_ids += run.token_ids
        query_lens.append(len(run.token_ids))
        starts.append(run.start)
        num_tokens += len(run.token_ids)
        logits_indices += range(num_tokens - run.num_logits, num_tokens)
    width = max(len(run.page_ids) for run in runs)
    page_tables = torch.tensor(
        [list(run.page_ids) + [0] * (width - len(run.page_ids)) for run in runs],
        dtype=torch.int32,
    )
    lens = torch.tensor(query_lens)
    first = torch.tensor(starts)
    query_start_loc = torch.zeros(len(runs) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=query_start_loc[1:])
    # Each token's run, then its position: its offset in the run plus the run's first position.
    owner = torch.repeat_interleave(torch.arange(len(runs)), lens)
    positions = torch.arange(num_tokens) - query_start_loc[:-1][owner] + first[owner]
    pages = page_tables[owner, positions // page_size].long()
    slots = pages * page_size + positions % page_size
    seq_lens = first + lens

    def to_device(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return values.to(device, dtype, non_blocking=True)

    meta = AttentionMetadata(
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        page_tables=to_device(page_tables, torch.int32),
        slot_mapping=to_device(slots, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(start + n for start, n in zip(starts, query_lens, strict=True)),
    )
    return ForwardInputs(
        to_device(torch.tensor(input_ids), torch.long),
        to_device(positions, torch.long),
        meta,
        to_device(torch.tensor(logits_indices, dtype=torch.long), torch.long),
    )
