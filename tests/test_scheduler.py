"""The scheduler on its own, no model: the tests play the model runner, feeding each sampling
sequence a token of their choosing, and check what every step schedules and what the pages do.

Pages of 4 tokens throughout; every expected value below is worked out by hand from the rules
in ``common/engine/scheduler.py``'s docstring, not read back from the code.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from common import config as config_module
from common.config import SchedulerConfig
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.page_manager import PageManager
from common.engine.sampler import SampledToken
from common.engine.scheduler import Scheduler
from common.engine.sequence import FinishReason, Sequence, SequenceStatus
from common.sampling_params import SamplingParams

PAGE = 4
EOS = 2


def make_scheduler(
    *,
    num_pages: int = 16,
    budget: int = 8,
    max_num_seqs: int = 256,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    max_prefill_tokens_while_decoding: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
    )
    pages = PageManager(num_pages, PAGE, enable_prefix_caching=prefix_caching)
    return Scheduler(config, pages, max_model_len, eos_token_ids=[EOS])


def prompt(first: int, length: int) -> list[int]:
    """``length`` distinct token ids from ``first`` on (never EOS)."""
    return list(range(first, first + length))


def add(scheduler: Scheduler, request_id: str, tokens: list[int], **params) -> Sequence:
    params.setdefault("max_tokens", 16)
    seq = Sequence.from_prompt(request_id, tokens, SamplingParams(**params))
    scheduler.add(seq)
    return seq


def shape(batch: list[ScheduledSequence]) -> list[tuple[str, int, bool]]:
    """A step as (request id, new tokens, samples) per sequence, in batch order."""
    return [(item.seq.request_id, item.num_new_tokens, item.will_sample) for item in batch]


def finish_step(
    scheduler: Scheduler, batch: list[ScheduledSequence], tokens: Mapping[str, int] | None = None
) -> list[SequenceOutput]:
    """Play the runner: each sampling sequence samples ``tokens[its id]`` (default 100)."""
    tokens = tokens or {}
    runs = [
        [SampledToken(tokens.get(item.seq.request_id, 100), None, None)]
        for item in batch
        if item.will_sample
    ]
    return scheduler.postprocess(batch, runs)


def step(
    scheduler: Scheduler, tokens: Mapping[str, int] | None = None
) -> list[tuple[str, int, bool]]:
    """Schedule one step and finish it; returns its ``shape``."""
    batch = scheduler.schedule()
    finish_step(scheduler, batch, tokens)
    return shape(batch)


# -- admission and the token budget -------------------------------------------------------------


def test_admission_is_first_come_first_served_and_decodes_go_first():
    scheduler = make_scheduler(budget=8)
    a = add(scheduler, "a", prompt(10, 5))
    b = add(scheduler, "b", prompt(20, 3))
    c = add(scheduler, "c", prompt(30, 4))
    # a takes 5 of the 8 tokens, b the other 3; c waits for the next step.
    assert step(scheduler) == [("a", 5, True), ("b", 3, True)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    assert c.status is SequenceStatus.WAITING and c.page_ids == []
    assert (len(a.page_ids), len(b.page_ids)) == (2, 1)  # ceil(5 / 4), ceil(3 / 4)
    assert scheduler.page_manager.num_free_pages == 16 - 3
    # Each decodes one token before the newcomer gets the remaining 6.
    assert step(scheduler) == [("a", 1, True), ("b", 1, True), ("c", 4, True)]
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (6, 4, 4)
    assert (a.num_tokens, b.num_tokens, c.num_tokens) == (7, 5, 5)


def test_no_more_running_sequences_than_max_num_seqs():
    scheduler = make_scheduler(budget=64, max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, prompt(10, 3))
    assert step(scheduler) == [("a", 3, True), ("b", 3, True)]
    assert step(scheduler) == [("a", 1, True), ("b", 1, True)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_decode():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "short", prompt(10, 3))
    long = add(scheduler, "long", prompt(40, 19))
    # Step 1: short's 3 tokens, then the first 5 of long's 19, which samples nothing yet.
    assert step(scheduler) == [("short", 3, True), ("long", 5, False)]
    assert long.num_computed_tokens == 5 and long.num_output_tokens == 0
    assert len(long.page_ids) == 2  # ceil(5 / 4): pages for what is computed, no more
    # Then the decode's token and 7 more of the prompt each step, until it is done.
    assert step(scheduler) == [("short", 1, True), ("long", 7, False)]
    assert long.num_computed_tokens == 12 and len(long.page_ids) == 3
    assert step(scheduler) == [("short", 1, True), ("long", 7, True)]
    assert long.num_computed_tokens == 19 and long.num_output_tokens == 1
    assert len(long.page_ids) == 5  # ceil(19 / 4)
    assert step(scheduler) == [("short", 1, True), ("long", 1, True)]
    # Every prompt token ran through the model exactly once.
    assert scheduler.num_prompt_tokens_computed == 3 + 19


def test_a_running_prefill_keeps_its_place_ahead_of_the_queue():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "long", prompt(40, 12))
    add(scheduler, "next", prompt(60, 2))
    assert step(scheduler) == [("long", 8, False)]
    # long's last 4 tokens come before next is admitted with the 4 left.
    assert step(scheduler) == [("long", 4, True), ("next", 2, True)]


def test_a_short_prompt_does_not_wait_behind_a_long_prompts_chunks():
    """Shortest first: a waiting prompt shorter than every running prompt's remainder takes its
    share of the step at once; the running prompt keeps a quarter of the budget however many
    short prompts come; a waiting prompt longer than the remainder waits its turn."""
    scheduler = make_scheduler(budget=8, num_pages=32)
    add(scheduler, "doc", prompt(40, 40))
    assert step(scheduler) == [("doc", 8, False)]
    add(scheduler, "chat", prompt(100, 3), max_tokens=1)
    assert step(scheduler) == [("doc", 5, False), ("chat", 3, True)]
    for i in range(4):
        add(scheduler, f"c{i}", prompt(200 + 10 * i, 3), max_tokens=1)
    assert step(scheduler) == [("doc", 2, False), ("c0", 3, True), ("c1", 3, True)]
    assert step(scheduler) == [("doc", 2, False), ("c2", 3, True), ("c3", 3, True)]
    add(scheduler, "big", prompt(300, 30), max_tokens=1)  # doc has 23 left
    assert step(scheduler) == [("doc", 8, False)]
    assert [seq.request_id for seq in scheduler.waiting] == ["big"]


def test_prompt_tokens_beside_decodes_are_capped_and_a_step_without_decodes_is_not():
    scheduler = make_scheduler(budget=16, max_prefill_tokens_while_decoding=3)
    add(scheduler, "short", prompt(10, 2))
    # No sequence is decoding yet: the whole budget goes to prompts.
    assert step(scheduler) == [("short", 2, True)]
    long = add(scheduler, "long", prompt(40, 8))
    other = add(scheduler, "other", prompt(60, 5))
    # Beside short's decode, 3 prompt tokens a step, shared in order: long first.
    assert step(scheduler) == [("short", 1, True), ("long", 3, False)]
    assert step(scheduler) == [("short", 1, True), ("long", 3, False)]
    assert step(scheduler) == [("short", 1, True), ("long", 2, True), ("other", 1, False)]
    assert (long.num_computed_tokens, other.num_computed_tokens) == (8, 1)
    # A sequence with one token left is a decode, never held back by the cap.
    shipped = Sequence.from_prompt("shipped", [7], SamplingParams(max_tokens=4))
    scheduler.add(shipped)
    assert step(scheduler) == [
        ("short", 1, True),
        ("long", 1, True),
        ("other", 3, False),
        ("shipped", 1, True),
    ]


def test_the_prompt_cap_must_be_positive():
    with pytest.raises(ValueError, match="--max-prefill-tokens-while-decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0).validate()


# -- the prefix cache ---------------------------------------------------------------------------


def run_alone(scheduler: Scheduler, request_id: str, tokens: list[int]) -> Sequence:
    """One token of output: the prompt is computed and its full pages filed, then freed."""
    seq = add(scheduler, request_id, tokens, max_tokens=1)
    while scheduler.has_work:
        step(scheduler)
    return seq


def test_cached_pages_count_as_computed_and_only_the_rest_is_scheduled():
    scheduler = make_scheduler(budget=64)
    pages = scheduler.page_manager
    first = prompt(10, 10)
    done = run_alone(scheduler, "first", first)
    assert done.finish_reason is FinishReason.LENGTH and pages.num_free_pages == 16
    [first_page, second_page] = pages.match_prefix(first)  # its two full pages stay filed

    # The same first 8 tokens, then 3 others: two pages hit, three tokens left to compute.
    second = add(scheduler, "second", [*first[:8], 90, 91, 92])
    [item] = scheduler.schedule()
    assert (item.num_new_tokens, item.will_sample) == (3, True)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert second.page_ids[:2] == [first_page, second_page] and len(second.page_ids) == 3
    assert pages.ref_count(first_page) == pages.ref_count(second_page) == 1
    finish_step(scheduler, [item])
    assert scheduler.num_prompt_tokens_computed == 10 + 3


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(budget=64)
    first = prompt(10, 8)
    run_alone(scheduler, "first", first)
    # All 8 tokens are filed in two pages, but the last token must run for its logits, so only
    # the first page counts: 4 cached, 4 computed.
    again = add(scheduler, "again", first)
    assert shape(scheduler.schedule()) == [("again", 4, True)]
    assert again.num_cached_tokens == 4


@pytest.mark.parametrize(
    "prefix_caching, params", [(False, {}), (True, {"prompt_logprobs": 1})], ids=["off", "scored"]
)
def test_no_cache_hits_when_caching_is_off_or_the_prompt_is_scored(prefix_caching, params):
    scheduler = make_scheduler(budget=64, prefix_caching=prefix_caching)
    first = prompt(10, 10)
    run_alone(scheduler, "first", first)
    again = add(scheduler, "again", first, **params)
    assert shape(scheduler.schedule()) == [("again", 10, True)]
    assert again.num_cached_tokens == 0


# -- preemption ---------------------------------------------------------------------------------


def sequences_filling_the_pool(
    names: str, prefix_caching: bool
) -> tuple[Scheduler, list[Sequence]]:
    """A 7-token prompt per name, admitted in that order, two pages each in a pool of just that
    many pages. After two steps each holds 9 tokens (generated: 100, 101) with 8 computed, so
    its next decode needs a third page, and none is free."""
    scheduler = make_scheduler(num_pages=2 * len(names), budget=64, prefix_caching=prefix_caching)
    seqs = [add(scheduler, n, prompt(10 + 20 * i, 7), max_tokens=3) for i, n in enumerate(names)]
    assert step(scheduler, dict.fromkeys(names, 100)) == [(n, 7, True) for n in names]
    assert step(scheduler, dict.fromkeys(names, 101)) == [(n, 1, True) for n in names]
    assert scheduler.page_manager.num_free_pages == 0
    assert [(s.num_tokens, s.num_computed_tokens) for s in seqs] == [(9, 8)] * len(names)
    return scheduler, seqs


def test_the_newest_sequence_is_preempted_for_pages_and_resumes_where_it_stopped():
    scheduler, [a, b, c] = sequences_filling_the_pool("abc", prefix_caching=False)
    d = add(scheduler, "d", prompt(90, 3), max_tokens=1)
    # a needs a third page: c, the newest, gives back both of its own and waits at the front of
    # the queue, ahead of d, and b takes the other. c's 9 tokens then need 3 pages, and none is
    # left this step.
    assert step(scheduler, dict.fromkeys("abc", 102)) == [("a", 1, True), ("b", 1, True)]
    assert scheduler.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.page_ids == [] and c.num_computed_tokens == 0
    assert list(scheduler.waiting) == [c, d] and c.output_token_ids == [100, 101]
    # a and b reached max_tokens (3) and freed their three pages each.
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == b.output_token_ids == [100, 101, 102]
    assert scheduler.page_manager.num_free_pages == 6
    # c recomputes its prompt and both generated tokens in one chunk, then samples its third.
    assert step(scheduler, {"c": 102}) == [("c", 9, True), ("d", 3, True)]
    assert c.output_token_ids == [100, 101, 102] and c.finish_reason is FinishReason.LENGTH
    assert c.num_cached_tokens == 0  # what it recomputed is not a cache hit
    assert scheduler.num_prompt_tokens_computed == 3 * 7 + 7 + 3  # c's prompt counted twice
    assert scheduler.page_manager.num_free_pages == 6 and not scheduler.has_work


def test_a_preempted_sequence_resumes_from_its_own_pages_still_in_the_cache():
    scheduler, [a, b] = sequences_filling_the_pool("ab", prefix_caching=True)
    # b's two full pages stay filed when it is preempted; a's third page is the one b freed
    # first (its second), so b's first page is still filed when b comes back after a finished.
    b_first_page, b_second_page = b.page_ids
    b_second_hash = scheduler.page_manager.page_hash(b_second_page)
    assert step(scheduler, {"a": 102}) == [("a", 1, True)]
    assert b.status is SequenceStatus.WAITING and a.finish_reason is FinishReason.LENGTH
    assert b_second_hash not in scheduler.page_manager.cached_hashes()  # a wrote over it
    [item] = scheduler.schedule()
    assert (item.seq, item.num_new_tokens, item.will_sample) == (b, 5, True)
    assert b.num_computed_tokens == 4 and b.page_ids[0] == b_first_page


# -- finishing and aborting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, tokens, reason",
    [
        ({"max_tokens": 3}, [7, 8, 9], FinishReason.LENGTH),
        ({}, [7, EOS], FinishReason.STOP),
        ({"stop_token_ids": [8]}, [7, 8], FinishReason.STOP),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], FinishReason.LENGTH),
    ],
    ids=["max_tokens", "eos", "stop_token_ids", "ignore_eos"],
)
def test_a_sequence_finishes_on_its_stop_token_and_frees_its_pages(params, tokens, reason):
    scheduler = make_scheduler(budget=64, prefix_caching=False)
    seq = add(scheduler, "r", prompt(10, 6), **params)
    outputs = []
    for token in tokens:
        assert seq.status is not SequenceStatus.FINISHED
        outputs += finish_step(scheduler, scheduler.schedule(), {"r": token})
    assert [(o.new_samples[0].token_id, o.left_batch) for o in outputs] == [
        *((t, False) for t in tokens[:-1]),
        (tokens[-1], True),
    ]
    assert seq.finish_reason is reason and seq.status is SequenceStatus.FINISHED
    assert seq.output_token_ids == tokens
    assert seq.page_ids == [] and scheduler.page_manager.num_free_pages == 16
    assert not scheduler.has_work


def test_a_sequence_stops_at_the_model_length():
    scheduler = make_scheduler(budget=64, max_model_len=8)
    seq = add(scheduler, "r", prompt(10, 6), max_tokens=16)
    step(scheduler)
    assert seq.finish_reason is None
    step(scheduler)  # the 8th token
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 8
    with pytest.raises(ValueError, match="maximum model length is 8"):
        add(scheduler, "long", prompt(10, 8))


def test_abort_frees_pages_wherever_the_sequence_is():
    scheduler = make_scheduler(budget=8)
    pages = scheduler.page_manager
    running = add(scheduler, "running", prompt(10, 12))
    waiting = add(scheduler, "waiting", prompt(30, 5))
    assert step(scheduler) == [("running", 8, False)]
    filed = pages.match_prefix(prompt(10, 8))
    assert len(filed) == 2 and pages.num_free_pages == 14
    assert scheduler.abort("nobody") is None
    assert scheduler.abort("waiting") is waiting
    assert waiting.finish_reason is FinishReason.ABORT and list(scheduler.waiting) == []
    assert scheduler.abort("running") is running
    assert running.finish_reason is FinishReason.ABORT and running.page_ids == []
    assert pages.num_free_pages == 16 and not scheduler.has_work
    # Its computed pages are free but still filed: a later prompt can use them.
    assert pages.match_prefix(prompt(10, 8)) == filed
    assert all(pages.ref_count(b) == 0 for b in filed)


@pytest.mark.parametrize(
    "device, dtype, flags, budget",
    [
        ("cuda", torch.bfloat16, set(), 2048),
        ("cpu", torch.float32, {"amx_bf16"}, 256),
        ("cpu", torch.bfloat16, {"avx512f", "avx512_bf16"}, 256),
        ("cpu", torch.bfloat16, {"avx512f", "amx_bf16"}, 1024),
    ],
)
def test_default_step_budget_follows_the_gemm_units(monkeypatch, device, dtype, flags, budget):
    """256 tokens fill a CPU core's float32 FMAs; bf16 GEMMs on AMX keep gaining to 2048 rows,
    so a bf16 model there takes steps of 1024; a GPU takes 2048."""
    monkeypatch.setattr(config_module, "has_amx_bf16", lambda: "amx_bf16" in flags)
    assert config_module.default_token_budget(torch.device(device), dtype) == budget


# -- the steady decode step ---------------------------------------------------------------------


def _play_workload(scheduler: Scheduler, seed: int, num_steps: int = 400) -> tuple[list, int]:
    """Drive ``scheduler`` through a random workload (arrivals, prompts, stop conditions, aborts,
    a pool small enough to preempt) and return a log of everything each step decided and
    changed, with the number of steps its steady path decided."""
    rng = torch.Generator().manual_seed(seed)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=rng))

    steady_steps = 0
    steady_decodes = scheduler._steady_decodes

    def counting() -> list[ScheduledSequence] | None:
        nonlocal steady_steps
        batch = steady_decodes()
        steady_steps += batch is not None
        return batch

    scheduler._steady_decodes = counting  # type: ignore[method-assign]
    log: list = []
    live: list[str] = []
    for step_index in range(num_steps):
        if draw(6) == 0 and step_index < num_steps - 100:
            request_id = f"r{step_index}"
            params = {"max_tokens": 1 + draw(40)}
            if draw(3) == 0:
                params["stop_token_ids"] = [50 + draw(4)]
            add(scheduler, request_id, prompt(10 + draw(5) * 7, 1 + draw(14)), **params)
            live.append(request_id)
        if live and draw(40) == 0:
            scheduler.abort(live.pop(draw(len(live))))
        batch = scheduler.schedule()
        # Mostly ordinary tokens; now and then EOS or a stop token.
        tokens = {
            item.seq.request_id: [EOS, 50, 51][draw(3)] if draw(25) == 0 else 60 + draw(30)
            for item in batch
        }
        outputs = finish_step(scheduler, batch, tokens)
        events = scheduler.page_manager.drain_events()
        log.append(
            (
                shape(batch),
                [(item.seq.request_id, list(item.seq.page_ids)) for item in batch],
                [
                    (o.seq.request_id, [s.token_id for s in o.new_samples], o.left_batch,
                     o.seq.finish_reason)
                    for o in outputs
                ],
                scheduler.page_manager.num_free_pages,
                scheduler.num_preemptions,
                (events.stored, events.removed),
            )
        )  # fmt: skip
    return log, steady_steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_steady_decode_step_decides_what_the_full_pass_would(seed):
    """The usual step (the last step's decodes again) is decided without the full pass: every
    step, page, token, finish, preemption and cache event is what the full pass alone gives."""

    def scheduler() -> Scheduler:
        return make_scheduler(num_pages=20, budget=6, max_num_seqs=4, max_model_len=40)

    full = scheduler()
    full._steady_decodes = lambda: None  # type: ignore[method-assign]
    log, steady_steps = _play_workload(scheduler(), seed)
    full_log, none = _play_workload(full, seed)
    assert none == 0
    assert log == full_log
    assert steady_steps > 60  # the workload reaches the steady step often
    assert any(step[4] for step in full_log)  # and preempts
