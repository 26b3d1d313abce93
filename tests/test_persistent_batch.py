"""The persistent batch (common/engine/persistent_batch.py): the rows it keeps from step to step
by events are the rows a batch built afresh from the same sequences holds, whatever order the
events come in; a step read off the rows is the step read off the sequences; and the scheduler
keeps the rows in step with its running sequences through a random workload."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.batch import flatten_decodes
from common.engine.persistent_batch import DecodeOutputs, DecodeStep, PersistentBatch
from common.engine.sampler import SampledToken, plain_argmax
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams
from tests.test_scheduler import EOS, PAGE, add, finish_step, make_scheduler, prompt

MAX_MODEL_LEN = 96
CPU = torch.device("cpu")


def fresh(batch: PersistentBatch) -> dict[str, list]:
    return PersistentBatch.columns_of(batch.seqs, PAGE, MAX_MODEL_LEN, [EOS])


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = 1 + rng.randrange(30)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 0.0, 0.7]),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=[50] if rng.random() < 0.2 else [],
        min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
        logprobs=1 if rng.random() < 0.1 else None,
    )


def random_sequence(rng: random.Random, index: int, next_page: list[int]) -> Sequence:
    """A sequence that could be running: a prompt, maybe some output, its KV computed up to
    its newest token (or a chunk short of it), and the pages that needs."""
    params = random_params(rng)
    seq = Sequence.from_prompt(f"s{index}", prompt(10, 1 + rng.randrange(20)), params)
    seq.token_ids += [60 + rng.randrange(30) for _ in range(rng.randrange(4))]
    seq.num_computed_tokens = seq.num_tokens - rng.choice([1, 1, 1, 3])
    seq.num_computed_tokens = max(0, seq.num_computed_tokens)
    take_pages(seq, -(-(seq.num_computed_tokens + 1) // PAGE), next_page)
    return seq


def take_pages(seq: Sequence, total: int, next_page: list[int]) -> None:
    while len(seq.page_ids) < total:
        seq.page_ids.append(next_page[0])
        next_page[0] += 1


def expected_checks(seq: Sequence) -> tuple[bool, bool]:
    """(whether ``seq``'s newest token may have stopped it, whether its newest computed
    position completed a page it had not filed), worked out from the sequence alone."""
    params = seq.params
    may_stop = (
        seq.grammar is not None
        or bool(params.stop_token_ids)
        or (not params.ignore_eos and seq.token_ids[-1] == EOS)
        or seq.num_output_tokens >= params.max_tokens
        or seq.num_tokens >= MAX_MODEL_LEN
    )
    filled = seq.num_computed_tokens >= (len(seq.page_hashes) + 1) * PAGE
    return may_stop, filled


@pytest.mark.parametrize("seed", range(6))
def test_events_in_any_order_keep_the_rows_a_rebuild_gives(seed):
    """Random admissions, finishes, preemptions, new pages, rows read again after a step that
    was not a plain decode, and plain decode steps: after every one the kept rows are the
    rows of a batch built afresh from the same sequences; a plain decode step writes each
    sequence as the scheduler would, and names every row whose stop or filled page is due."""
    rng = random.Random(seed)
    batch = PersistentBatch(PAGE, MAX_MODEL_LEN, [EOS])
    next_page = [1]
    made = 0
    for _ in range(300):
        event = rng.randrange(6)
        seqs = batch.seqs
        if event == 0 or not seqs:  # admitted (or back after a preemption)
            seq = random_sequence(rng, made, next_page)
            made += 1
            batch.add(seq)
        elif event == 1:  # finished, preempted or aborted
            batch.remove(rng.choice(seqs))
        elif event == 2:  # a decoding row's next position starts a page
            starting = batch.rows_starting_pages(0)
            assert starting == [
                row
                for row, seq in enumerate(seqs)
                if seq.num_computed_tokens >= len(seq.page_ids) * PAGE
            ]
            page_ids = list(range(next_page[0], next_page[0] + len(starting)))
            next_page[0] += len(starting)
            for row, page_id in zip(starting, page_ids, strict=True):
                seqs[row].page_ids.append(page_id)
            batch.add_pages(starting, page_ids)
        elif event == 3:  # a step that was not a plain decode changed one row
            seq = rng.choice(seqs)
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(60 + rng.randrange(30))
            take_pages(seq, -(-(seq.num_computed_tokens + 1) // PAGE), next_page)
            if rng.random() < 0.5:
                seq.page_hashes.append(rng.randrange(1 << 30))  # a page filed
            batch.refresh(seq)
        elif batch.decodes_everywhere():  # a plain decode step over every row
            for row in batch.rows_starting_pages(0):
                seqs[row].page_ids.append(next_page[0])
                batch.add_pages([row], [next_page[0]])
                next_page[0] += 1
            before = [(list(seq.token_ids), seq.num_computed_tokens) for seq in seqs]
            tokens = [rng.choice([EOS, 50, 60 + rng.randrange(30)]) for _ in seqs]
            samples = [SampledToken(token) for token in tokens]
            advanced = batch.advance(samples)
            for seq, (token_ids, computed), token, sample, start in zip(
                seqs, before, tokens, samples, advanced.starts, strict=True
            ):
                assert seq.token_ids == [*token_ids, token]
                assert seq.samples[-1] is sample
                assert seq.num_computed_tokens == computed + 1
                assert start == seq.num_output_tokens - 1
            for row, seq in enumerate(seqs):
                may_stop, filled = expected_checks(seq)
                if may_stop:  # it may be named when it has not stopped, never missed
                    assert advanced.check is not None and advanced.check[row], row
                assert filled == (advanced.filled is not None and bool(advanced.filled[row]))
            for row, seq in enumerate(seqs):  # the scheduler files the filled pages
                if advanced.filled is not None and advanced.filled[row]:
                    full = seq.num_computed_tokens // PAGE
                    seq.page_hashes += [0] * (full - len(seq.page_hashes))
                    batch.note_hashed(row, len(seq.page_hashes))
        else:
            continue
        assert batch.columns() == fresh(batch)
        assert batch.decodes_everywhere() == all(
            seq.num_tokens - seq.num_computed_tokens == 1 for seq in batch.seqs
        )
        assert batch.all_plain_argmax() == all(
            plain_argmax(seq.params, seq.num_output_tokens) for seq in batch.seqs
        )
        assert batch.ends_by_length_next() == any(
            seq.num_tokens + 1 >= min(seq.num_prompt_tokens + seq.params.max_tokens, MAX_MODEL_LEN)
            for seq in batch.seqs
        )


@pytest.mark.parametrize("lead", [0, 1])
def test_a_steps_inputs_read_off_the_rows_are_those_read_off_the_sequences(lead):
    rng = random.Random(lead)
    batch = PersistentBatch(PAGE, MAX_MODEL_LEN, [EOS])
    next_page = [1]
    for index in range(9):
        seq = random_sequence(rng, index, next_page)
        seq.num_computed_tokens = seq.num_tokens - 1
        take_pages(seq, -(-(seq.num_computed_tokens + 1 + lead) // PAGE), next_page)
        batch.add(seq)
    batch.remove(batch.seqs[3])  # the rows after it moved up
    from_rows = batch.forward_inputs(CPU, None, lead)
    after = torch.arange(len(batch)) if lead else None
    from_seqs = flatten_decodes(batch.seqs, PAGE, CPU, after=after)
    assert from_rows.positions.tolist() == from_seqs.positions.tolist()
    assert from_rows.logits_indices.tolist() == from_seqs.logits_indices.tolist()
    if not lead:
        assert from_rows.input_ids.tolist() == from_seqs.input_ids.tolist()
    for field in ("query_start_loc", "seq_lens", "page_tables", "slot_mapping"):
        assert getattr(from_rows.meta, field).tolist() == getattr(from_seqs.meta, field).tolist()
    assert from_rows.meta.max_seq_len == from_seqs.meta.max_seq_len


def _play(scheduler: Scheduler, seed: int, num_steps: int = 300) -> int:
    """A random workload (arrivals, stop conditions, logprobs, aborts, a pool small enough to
    preempt); after every step the scheduler's rows are a rebuild of its running sequences,
    and a plain decode step's token columns and full deltas cover its rows. Returns how many
    steps were plain decode steps read off the rows."""
    rng = random.Random(seed)
    live: list[str] = []
    plain_steps = 0
    for index in range(num_steps):
        if rng.randrange(5) == 0 and index < num_steps - 80:
            params = {"max_tokens": 1 + rng.randrange(30)}
            if rng.randrange(3) == 0:
                params["stop_token_ids"] = [50 + rng.randrange(3)]
            if rng.randrange(8) == 0:
                params["logprobs"] = 1
            add(scheduler, f"r{index}", prompt(10 + rng.randrange(6) * 7, 1 + rng.randrange(14)),
                **params)  # fmt: skip
            live.append(f"r{index}")
        if live and rng.randrange(40) == 0:
            scheduler.abort(live.pop(rng.randrange(len(live))))
        batch = scheduler.schedule()
        tokens = {
            item.seq.request_id: rng.choice([EOS, 50, 51]) if rng.randrange(20) == 0 else 60
            for item in batch
        }
        outputs = finish_step(scheduler, batch, tokens)
        if isinstance(outputs, DecodeOutputs):
            assert isinstance(batch, DecodeStep)
            plain_steps += 1
            columns = outputs.columns
            in_columns = set(columns.request_ids)
            full = {outputs[row].seq.request_id for row in columns.full_rows}
            assert in_columns.isdisjoint(full)
            assert in_columns | full == {out.seq.request_id for out in outputs}
            for request_id, token, start in zip(
                columns.request_ids, columns.token_ids, columns.start_indices, strict=True
            ):
                out = next(out for out in outputs if out.seq.request_id == request_id)
                assert out.seq.output_token_ids[start] == token == out.new_samples[0].token_id
                assert not out.left_batch and out.seq.params.logprobs is None
            assert {outputs[row].seq.request_id for row in outputs.left} == {
                out.seq.request_id for out in outputs if out.left_batch
            }
        assert scheduler.batch.seqs == scheduler.running
        assert scheduler.batch.columns() == PersistentBatch.columns_of(
            scheduler.running, PAGE, scheduler.max_model_len, [EOS]
        )
    return plain_steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_scheduler_keeps_its_rows_in_step_with_its_running_sequences(seed):
    scheduler = make_scheduler(num_pages=24, budget=8, max_num_seqs=5, max_model_len=48)
    plain_steps = _play(scheduler, seed)
    assert plain_steps > 40  # the workload reaches the plain decode step often
    assert scheduler.num_preemptions > 0


def test_a_sliding_window_gives_back_pages_on_the_plain_decode_step_too():
    """Under a sliding window the plain decode step visits every row for the pages it leaves
    behind: the rows still match, and pages are given back."""
    scheduler = make_scheduler(num_pages=40, budget=8, max_num_seqs=4, max_model_len=64)
    scheduler.release_window = 6
    seqs = [add(scheduler, f"w{i}", prompt(10 + i, 5), max_tokens=40) for i in range(3)]
    for _ in range(30):
        batch = scheduler.schedule()
        finish_step(scheduler, batch)
        assert scheduler.batch.columns() == PersistentBatch.columns_of(
            scheduler.running, PAGE, scheduler.max_model_len, [EOS]
        )
    assert scheduler.num_released_pages > 0
    assert all(seq.num_released_pages > 0 for seq in seqs)
