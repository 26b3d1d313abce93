"""The batch preparation: ``ModelRunner.prepare`` turns scheduled sequences into the forward's
token ids, positions and attention metadata (``kernels/interface.py``). No model runs: the
sequences are set up by hand, and every expected value is worked out by hand below.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from common.engine.batch import (
    ForwardInputs,
    HostStaging,
    PageTables,
    ScheduledSequence,
    flatten_runs,
)
from common.engine.kv_pool import KVPool, kv_layout
from common.engine.model_runner import ModelRunner
from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams

PAGE = 4


def runner() -> ModelRunner:
    """A runner over a 16-page pool of 4-token pages; ``prepare`` needs nothing else."""
    layout = kv_layout(torch.float32, page_size=PAGE, num_layers=1, num_kv_heads=1, head_dim=8)
    return ModelRunner(model=None, pool=KVPool(layout, 16, "cpu"), sampler=None)


def sequence(
    request_id: str,
    prompt: list[int],
    *,
    generated: Iterable[int] = (),
    computed: int,
    pages: list[int],
    **params,
) -> Sequence:
    seq = Sequence.from_prompt(request_id, prompt, SamplingParams(**params))
    seq.token_ids += generated
    seq.num_computed_tokens = computed
    seq.page_ids = list(pages)
    return seq


def check_metadata(inputs: ForwardInputs) -> None:
    """The dtypes ``kernels/interface.py`` promises the backends."""
    meta = inputs.meta
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.long
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.page_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64


def test_a_chunked_prefill_a_cached_prefix_and_decodes_in_one_step():
    # a: the middle chunk of a 10-token prompt, positions 4-8, on pages 7, 2, 9; it does not
    #    reach the prompt's end, so it samples nothing.
    a = sequence("a", list(range(10, 20)), computed=4, pages=[7, 2, 9])
    # b: a 6-token prompt whose first page (7, shared with a: the same 4 tokens) came from the
    #    prefix cache; positions 4-5 on page 5, then it samples.
    b = sequence("b", [10, 11, 12, 13, 40, 41], computed=4, pages=[7, 5])
    # c: decoding its third token: 5 prompt + 2 generated, the newest at position 6.
    c = sequence("c", [50, 51, 52, 53, 54], generated=[55, 56], computed=6, pages=[11, 3])
    # d: decoding into a fresh page: position 8 is the first slot of its third page, page 0.
    d = sequence("d", list(range(60, 68)), generated=[68], computed=8, pages=[14, 1, 0])
    batch = [
        ScheduledSequence.of(a, 5),
        ScheduledSequence.of(b, 2),
        ScheduledSequence.of(c, 1),
        ScheduledSequence.of(d, 1),
    ]
    assert [item.will_sample for item in batch] == [False, True, True, True]

    inputs = runner().prepare(batch, [[], [], [], []])
    check_metadata(inputs)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [14, 15, 16, 17, 18, 40, 41, 56, 68]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 4, 5, 6, 8]
    # page id * 4 + position % 4, the page being the sequence's (position // 4)-th:
    # a: 4-7 on page 2 (8-11), 8 on page 9 (36); b: 4-5 on page 5 (20, 21); c: 6 on page 3
    # (14); d: 8 on page 0 (0).
    assert meta.slot_mapping.tolist() == [8, 9, 10, 11, 36, 20, 21, 14, 0]
    assert meta.query_start_loc.tolist() == [0, 5, 7, 8, 9]
    assert meta.seq_lens.tolist() == [9, 6, 7, 9]  # context after the step: start + new tokens
    assert (meta.max_query_len, meta.max_seq_len) == (5, 9)
    # One row per sequence, its pages in order; shorter rows are padded to the widest.
    tables = meta.page_tables.tolist()
    assert [row[:n] for row, n in zip(tables, (3, 2, 2, 3), strict=True)] == [
        [7, 2, 9],
        [7, 5],
        [11, 3],
        [14, 1, 0],
    ]
    # Logits only where a sequence samples: the last row of b, c and d.
    assert inputs.logits_indices.tolist() == [6, 7, 8]


def test_proposed_tokens_follow_the_last_token_and_all_want_logits():
    # A step of decodes: e verifies 3 proposed tokens after its last one, at position 5, the
    # run crossing from its second page (6) into its third (12); f proposes none.
    e = sequence("e", [1, 2, 3, 4, 5], generated=[6], computed=5, pages=[4, 6, 12])
    f = sequence("f", [7, 8, 9], generated=[10], computed=3, pages=[8])
    batch = [ScheduledSequence.of(e, 1, num_draft_slots=3), ScheduledSequence.of(f, 1)]
    inputs = runner().prepare(batch, [[70, 71, 72], []])
    check_metadata(inputs)
    assert inputs.input_ids.tolist() == [6, 70, 71, 72, 10]
    assert inputs.positions.tolist() == [5, 6, 7, 8, 3]
    # e: 5-7 on page 6 (25-27), 8 on page 12 (48); f: 3 on page 8 (35).
    assert inputs.meta.slot_mapping.tolist() == [25, 26, 27, 48, 35]
    assert inputs.meta.query_start_loc.tolist() == [0, 4, 5]
    assert inputs.meta.seq_lens.tolist() == [9, 4]
    # Every row of e's run samples (the target's choice after 0, 1, 2 and 3 accepted), and f's.
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4]


def test_a_scored_prompt_wants_logits_for_each_of_its_positions():
    """With prompt logprobs, position p's logits score prompt token p + 1: every position of a
    chunk wants them, but the prompt's last, whose logits sample the first token instead."""
    prompt = list(range(20, 30))
    seq = sequence("s", prompt, computed=0, pages=[3, 4, 5], prompt_logprobs=0)
    first = runner().prepare([ScheduledSequence.of(seq, 6)], [[]])
    assert first.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert first.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]  # scoring tokens 1-6
    # Next chunk, once positions 0-5 are scored: 6-8 score tokens 7-9, 9 samples.
    seq.num_computed_tokens = 6
    seq.prompt_logprobs = [None] * 6  # only their count matters here
    second = runner().prepare([ScheduledSequence.of(seq, 4)], [[]])
    assert second.positions.tolist() == [6, 7, 8, 9]
    assert second.meta.slot_mapping.tolist() == [18, 19, 20, 21]
    assert second.logits_indices.tolist() == [0, 1, 2, 3]


def test_page_tables_follow_lists_that_grow_or_are_replaced_between_steps():
    """The runner keeps each sequence's pages as an array from step to step: a page appended to
    the list, or a list replaced (a preempted sequence admitted again), shows in the next
    step's page tables and slots, as a runner seeing the lists for the first time gives them."""
    kept = runner()
    a = sequence("a", [1, 2, 3], generated=[4], computed=3, pages=[5])
    b = sequence("b", [1, 2, 3, 4, 5], generated=[6, 7, 8], computed=7, pages=[8, 9])

    def step(*seqs: Sequence) -> ForwardInputs:
        batch = [ScheduledSequence.of(seq, 1) for seq in seqs]
        inputs = kept.prepare(batch, [[] for _ in seqs])
        fresh = runner().prepare(batch, [[] for _ in seqs])
        assert torch.equal(inputs.meta.page_tables, fresh.meta.page_tables)
        assert torch.equal(inputs.meta.slot_mapping, fresh.meta.slot_mapping)
        return inputs

    assert step(a, b).meta.slot_mapping.tolist() == [5 * PAGE + 3, 9 * PAGE + 3]
    a.token_ids.append(10)
    a.num_computed_tokens = 4
    a.page_ids.append(12)  # a's fifth token starts its second page
    b.page_ids = [14, 15]  # b preempted and recomputed into other pages
    inputs = step(a, b)
    assert inputs.meta.page_tables.tolist() == [[5, 12], [14, 15]]
    assert inputs.meta.slot_mapping.tolist() == [12 * PAGE, 15 * PAGE + 3]
    assert step(b).meta.page_tables.tolist() == [[14, 15]]  # a left the batch


def test_a_step_of_decodes_alone_gives_what_its_token_runs_give():
    """A step of decodes alone is built straight from its sequences; every input equals what
    the general flattening makes of the same step's token runs."""
    seqs = [
        sequence("a", [1, 2, 3], generated=[4], computed=3, pages=[5]),
        sequence("b", [1, 2, 3, 4, 5], generated=[6, 7, 8], computed=7, pages=[8, 9]),
        sequence("c", [9] * 8, generated=[3], computed=8, pages=[2, 6, 11]),  # a fresh page
    ]
    batch = [ScheduledSequence.of(seq, 1) for seq in seqs]
    fast = runner().prepare(batch, [[] for _ in seqs])
    general = runner()
    runs = general.token_runs(batch, [[] for _ in seqs])
    slow = flatten_runs(runs, PAGE, torch.device("cpu"))
    check_metadata(fast)
    assert fast.input_ids.tolist() == slow.input_ids.tolist() == [4, 8, 3]
    assert fast.positions.tolist() == slow.positions.tolist() == [3, 7, 8]
    assert fast.logits_indices.tolist() == slow.logits_indices.tolist() == [0, 1, 2]
    for name in ("query_start_loc", "seq_lens", "page_tables", "slot_mapping"):
        assert torch.equal(getattr(fast.meta, name), getattr(slow.meta, name)), name
    assert fast.meta.slot_mapping.tolist() == [5 * PAGE + 3, 9 * PAGE + 3, 11 * PAGE]
    assert (fast.meta.max_query_len, fast.meta.max_seq_len) == (1, 9)


def test_page_tables_reuse_rows_and_pad_with_zeros():
    """Rows given back by sequences that left are taken by new ones with nothing of the old
    pages showing past the new list's end; a list that shrank, or that comes twice in one
    step, still reads as itself; the table grows past its first rows and width."""
    tables = PageTables()
    lists = [list(range(10 * i, 10 * i + i + 1)) for i in range(12)]  # 1 to 12 pages
    expected = np.zeros((12, 12), np.int32)
    for i, pages in enumerate(lists):
        expected[i, : len(pages)] = pages
    assert tables.gather(lists).tolist() == expected.tolist()
    short = [7]
    assert tables.gather([short, lists[11]]).tolist() == [[7] + [0] * 11, lists[11]]
    lists[11].append(99)
    lists[11][:] = lists[11][:3]  # shrank: held rows are not trusted past the list's length
    assert tables.gather([lists[11], short, lists[11]]).tolist() == [
        lists[11],
        [7, 0, 0],
        lists[11],
    ]
    assert tables.gather([]).shape == (0, 0)


def test_page_tables_asked_for_the_same_lists_again_follow_their_changes():
    """The usual step asks for the very lists of the step before, in the same order, some a page
    longer: only what changed is written, and every step's tables are what a fresh table gives,
    through growth past the table's width, a list cleared and refilled, a list asked twice, and
    steps that change the lists or their order."""
    rng = np.random.default_rng(0)
    tables = PageTables()
    lists = [list(rng.integers(1, 1000, size=int(rng.integers(1, 4)))) for _ in range(6)]
    asked = list(lists)
    for step in range(200):
        if step % 50 == 49:
            asked = [lists[i] for i in rng.permutation(len(lists))[:4]] + [lists[0]]
        # A list is only ever extended, or cleared and given fewer pages than it had.
        victim = lists[int(rng.integers(len(lists)))]
        if rng.random() < 0.05 and len(victim) > 1:
            victim[:] = rng.integers(1, 1000, size=int(rng.integers(1, len(victim)))).tolist()
        for pages in lists:
            if pages is not victim and rng.random() < 0.3:
                pages.extend(rng.integers(1, 1000, size=int(rng.integers(1, 3))).tolist())
        assert tables.gather(asked).tolist() == PageTables().gather(asked).tolist(), step
    assert max(map(len, lists)) > 16  # past the table's first width


def test_one_buffer_carries_arrays_of_mixed_dtypes_and_shapes():
    """The CUDA path's packing, run on the CPU: int64 and int32 arrays of odd byte counts, a
    2-D table and an empty array come out of the one buffer with their values, dtypes and
    shapes, however the previous step's were."""
    staging = HostStaging()
    for size in (3, 1000):  # the second outgrows the first buffers
        arrays = [
            np.arange(size, dtype=np.int64) - 7,
            np.arange(size, dtype=np.int32)[::-1].copy(),
            np.arange(2 * size, dtype=np.int32).reshape(2, size),
            np.zeros(0, dtype=np.int64),
            np.array([2**40, -1], dtype=np.int64),
        ]
        out = staging.through_one_buffer(arrays, torch.device("cpu"), pinned=False)
        for array, tensor in zip(arrays, out, strict=True):
            assert tensor.dtype == torch.from_numpy(array).dtype
            assert tensor.tolist() == array.tolist()


def test_a_batch_is_a_plain_argmax_once_every_row_asks_for_nothing_else():
    """The runner takes a step's argmax alone when every row is greedy with nothing to report,
    ban, bias or penalise; a batch found so stays so while its rows are the same (min_tokens
    is passed only once), and a row that asks for more makes a batch take the sampler."""
    kept = runner()
    plain = sequence("a", [1, 2, 3], generated=[4], computed=3, pages=[5], temperature=0.0)
    banning = sequence(
        "b", [1, 2], generated=[6], computed=2, pages=[8], temperature=0.0, min_tokens=2
    )
    batch = [ScheduledSequence.of(seq, 1) for seq in (plain, banning)]
    assert not kept._all_plain_argmax(batch)  # b may not end before its second token
    banning.token_ids.append(7)
    assert kept._all_plain_argmax(batch)
    assert kept._all_plain_argmax(list(batch))  # the same rows: known
    reporting = sequence(
        "c", [1], generated=[2], computed=1, pages=[9], temperature=0.0, logprobs=1
    )
    assert not kept._all_plain_argmax([*batch, ScheduledSequence.of(reporting, 1)])
    sampling = sequence("d", [1], generated=[2], computed=1, pages=[9], temperature=0.7)
    assert not kept._all_plain_argmax([ScheduledSequence.of(sampling, 1)])
