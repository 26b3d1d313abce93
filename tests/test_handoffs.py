"""The decode side's handoff books (decode_worker/handoffs.py), driven in-process: a real decode
engine keeps the pages, a fake transfer (fake_transfer.py) lets each test decide when a fetch
ends and how, and a fake clock stands in for the timeouts. No processes, no sockets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest
from engines import build_engine
from fake_transfer import BACKEND, FakeReceiver
from prometheus_client import REGISTRY
from tiny_models import build_tiny_model, random_prompts

from common.engine.llm_engine import LLMEngine
from common.engine.sequence import Sequence
from common.protocol import Handoff, HandoffPart, RequestFailed, TokenSample
from common.sampling_params import SamplingParams
from common.service.worker_base import WorkerService
from decode_worker.handoffs import ABORT_MEMORY_S, PARTS_TIMEOUT_S, Handoffs
from decode_worker.worker import size_problem
from kernels.sizes import ceil_div
from kvtransfer import TransferParams

NUM_PAGES = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = random_prompts(1, seed=1, min_len=70, max_len=70)[0]  # five pages of 16
FIRST = TokenSample(7, -0.5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("model"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class WorkerSide:
    """What ``Handoffs`` reaches of the worker: WorkerService's own ``checked_params`` and
    ``admit``, with the router link replaced by the list of failures it would have carried."""

    engine: LLMEngine
    failures: list[RequestFailed] = field(default_factory=list)

    checked_params = WorkerService.checked_params
    admit = WorkerService.admit

    @property
    def scheduler(self):
        return self.engine.scheduler

    def fail(self, request_id: str, error: str, retryable: bool) -> None:
        self.failures.append(RequestFailed(request_id, error, retryable))


@dataclass
class Decode:
    engine: LLMEngine
    receiver: FakeReceiver
    worker: WorkerSide
    clock: Clock
    handoffs: Handoffs

    @property
    def num_free(self) -> int:
        return self.engine.page_manager.num_free_pages

    def waiting(self, request_id: str):
        [seq] = [s for s in self.engine.scheduler.waiting if s.request_id == request_id]
        return seq


@pytest.fixture
def decode(model) -> Decode:
    engine = build_engine(model, num_pages=NUM_PAGES, max_model_len=256, role="decode")
    receiver, worker, clock = FakeReceiver(engine.pool), WorkerSide(engine), Clock()
    handoffs = Handoffs(
        receiver,
        engine.scheduler,
        checked_params=worker.checked_params,
        admit=worker.admit,
        fail=worker.fail,
        fetch_timeout=10.0,
        clock=clock,
    )
    return Decode(engine, receiver, worker, clock, handoffs)


def transfer(num_pages: int, first_page: int = 0) -> dict:
    # Source page ids are the prefill worker's business; only their count matters here.
    pages = list(range(100 + first_page, 100 + first_page + num_pages))
    return TransferParams(BACKEND, "inproc://p", "p", pages, time.time() + 30)


def handoff(request_id, prompt=PROMPT, first_page=0, num_parts=0, params=GREEDY) -> Handoff:
    num_pages = ceil_div(len(prompt), 16) - first_page
    return Handoff(
        request_id, prompt, params, FIRST, transfer(num_pages, first_page),
        prefill_done_at=time.time(), first_page=first_page, num_parts=num_parts,
    )  # fmt: skip


def part(request_id, index, first_page, num_pages, prompt=PROMPT) -> HandoffPart:
    return HandoffPart(
        request_id, index, first_page, len(prompt), f"{request_id}/part{index}",
        transfer(num_pages, first_page),
    )  # fmt: skip


def sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


RECEIVED = "pdserve_kv_pages_received_total"
FALLBACKS = "pdserve_kv_transfer_fallbacks_total"
HANDOFF_COUNT = "pdserve_kv_handoff_seconds_count"


def test_a_handoff_without_parts_fetches_every_page_then_admits_the_prompt_computed(decode):
    received, timed = sample(RECEIVED), sample(HANDOFF_COUNT)
    decode.handoffs.accept_handoff(handoff("r"))
    [(transfer_id, dst)] = decode.receiver.started
    assert transfer_id == "r" and len(dst) == 5
    assert decode.num_free == NUM_PAGES - 5  # reserved before the fetch
    assert decode.handoffs.num_pending() == 1 and not decode.engine.scheduler.holds("r")
    decode.handoffs.poll()  # nothing has arrived yet
    assert not decode.engine.scheduler.holds("r")

    decode.receiver.complete("r")
    decode.handoffs.poll()
    seq = decode.waiting("r")
    assert seq.page_ids == dst and seq.num_computed_tokens == len(PROMPT)
    assert seq.token_ids == [*PROMPT, FIRST.token_id] and seq.handoff_wait_s is not None
    assert decode.handoffs.num_pending() == 0 and not decode.worker.failures
    assert sample(RECEIVED) == received + 5 and sample(HANDOFF_COUNT) == timed + 1
    # The engine takes it as prefilled: its first step decodes one token, computes no prompt.
    [item] = decode.engine.scheduler.schedule()
    assert item.seq is seq and item.num_new_tokens == 1
    assert decode.engine.scheduler.num_prompt_tokens_computed == 0


def test_parts_reserve_their_own_pages_fetch_one_by_one_and_settle_when_every_page_is_in(decode):
    received = sample(RECEIVED)
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    assert decode.num_free == NUM_PAGES - 2  # the pages the part brings, not the prompt's
    [(_, first_dst)] = decode.receiver.started
    decode.handoffs.accept_part(part("r", 1, 2, 1))
    assert decode.num_free == NUM_PAGES - 3
    decode.handoffs.accept_handoff(handoff("r", first_page=3, num_parts=2))
    ids = [transfer_id for transfer_id, _ in decode.receiver.started]
    assert ids == ["r/part0", "r/part1", "r"]
    reserved = [page for _, dst in decode.receiver.started for page in dst]
    assert len(set(reserved)) == 5 and decode.num_free == NUM_PAGES - 5  # nothing more

    for transfer_id in ("r/part0", "r"):
        decode.receiver.complete(transfer_id)
        decode.handoffs.poll()
        assert not decode.engine.scheduler.holds("r"), f"admitted after {transfer_id} alone"
    decode.receiver.complete("r/part1")
    decode.handoffs.poll()
    seq = decode.waiting("r")
    assert seq.page_ids == reserved and seq.page_ids[:2] == first_dst
    assert seq.num_computed_tokens == len(PROMPT) and decode.num_free == NUM_PAGES - 5
    assert sample(RECEIVED) == received + 5 and decode.handoffs.num_pending() == 0


def test_a_failed_fetch_frees_the_pages_and_the_prompt_is_prefilled_here(decode):
    fallbacks, received = sample(FALLBACKS), sample(RECEIVED)
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    decode.handoffs.accept_handoff(handoff("r", first_page=2, num_parts=1))
    decode.receiver.fail("r/part0", "the lease ran out")
    decode.handoffs.poll()
    assert not decode.engine.scheduler.holds("r")  # the handoff's fetch still writes
    assert decode.num_free == NUM_PAGES - 5
    decode.receiver.complete("r")
    decode.handoffs.poll()
    seq = decode.waiting("r")
    assert seq.page_ids == [] and seq.num_computed_tokens == 0  # prefilled from scratch
    assert seq.token_ids == [*PROMPT, FIRST.token_id]
    assert decode.num_free == NUM_PAGES and decode.handoffs.num_pending() == 0
    assert sample(FALLBACKS) == fallbacks + 1
    assert sample(RECEIVED) == received + 3  # the part that failed brought nothing
    assert not decode.worker.failures  # not lost: served here


def test_a_handoff_that_cannot_be_fetched_fails_retryable_and_keeps_nothing(decode):
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    bad = handoff("r", first_page=2, num_parts=1)
    bad.transfer = replace(bad.transfer, page_ids=[0])  # three are missing
    decode.handoffs.accept_handoff(bad)
    assert decode.receiver.aborted == ["r/part0"]
    assert decode.worker.failures[0].request_id == "r"
    assert decode.worker.failures[0].retryable
    assert decode.worker.failures[0].error.startswith("bad handoff: 1 pages offered after page 2")
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES and decode.handoffs.num_pending() == 0
    assert not decode.engine.scheduler.holds("r")


def test_bad_sampling_params_fail_the_request_for_good_and_drop_its_parts(decode):
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    decode.handoffs.accept_handoff(handoff("r", first_page=2, num_parts=1, params=GREEDY))
    decode.handoffs.accept_part(part("s", 0, 0, 2))
    bad = handoff("s", first_page=2, num_parts=1)
    # Out of range values never make params (their constructor refuses them, the codec drops the
    # message); a token id past this model's vocabulary is what only the worker can tell.
    vocab_size = decode.engine.model_config.vocab_size
    bad.params = replace(bad.params, stop_token_ids=[vocab_size])
    decode.handoffs.accept_handoff(bad)
    [failure] = decode.worker.failures
    assert failure.request_id == "s" and not failure.retryable
    assert "bad sampling params" in failure.error and "stop_token_ids" in failure.error
    assert decode.receiver.aborted == ["s/part0"]
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES - 5  # only r's pages are still reserved


def test_abort_while_parts_are_in_flight_withdraws_them_and_frees_the_pages(decode):
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    decode.handoffs.accept_part(part("r", 1, 2, 1))
    decode.receiver.complete("r/part0")
    decode.handoffs.poll()
    decode.handoffs.withdraw_parts("r")  # the prefill worker's AbortRequest
    assert decode.receiver.aborted == ["r/part1"]
    assert decode.handoffs.num_pending() == 0
    # The pages stay reserved until the receiver says nothing writes them any more.
    assert decode.num_free == NUM_PAGES - 3
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES
    # A part that straggles in after the withdrawal reserves nothing.
    decode.handoffs.accept_part(part("r", 2, 3, 1))
    assert decode.num_free == NUM_PAGES


def test_the_routers_abort_drops_a_handoff_in_flight_and_one_that_comes_late(decode):
    decode.handoffs.accept_handoff(handoff("r"))
    decode.handoffs.withdraw_parts("r")  # only parts: a handed-off request is the router's
    assert decode.receiver.aborted == [] and decode.handoffs.num_pending() == 1
    decode.handoffs.remember_abort("r")
    assert decode.handoffs.discard("r") and not decode.handoffs.discard("r")
    assert decode.receiver.aborted == ["r"]
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES and not decode.engine.scheduler.holds("r")

    decode.handoffs.remember_abort("late")
    decode.handoffs.accept_part(part("late", 0, 0, 2))
    decode.handoffs.accept_handoff(handoff("late"))
    assert [transfer_id for transfer_id, _ in decode.receiver.started] == ["r"]
    assert decode.num_free == NUM_PAGES
    # Until the router sends the request here again: its latest word wins.
    decode.handoffs.forget_abort("late")
    decode.handoffs.accept_handoff(handoff("late"))
    assert decode.receiver.started[-1][0] == "late"


def test_aborted_ids_are_forgotten_after_a_while(decode):
    decode.handoffs.remember_abort("r")
    decode.clock.now += ABORT_MEMORY_S - 1
    decode.handoffs.accept_handoff(handoff("r"))
    assert decode.receiver.started == []
    decode.clock.now += 2
    decode.handoffs.accept_handoff(handoff("r"))
    assert [transfer_id for transfer_id, _ in decode.receiver.started] == ["r"]


def test_parts_whose_handoff_never_comes_expire_when_the_latest_parts_lease_ends(decode):
    decode.handoffs.accept_part(part("r", 0, 0, 2))  # leases of 30 s (``transfer``)
    decode.clock.now += 20
    decode.handoffs.accept_part(part("r", 1, 2, 1))  # the handoff is due 30 s from here
    decode.receiver.complete("r/part0")
    decode.clock.now += 25
    decode.handoffs.poll()
    assert decode.receiver.aborted == [] and decode.handoffs.num_pending() == 1
    decode.clock.now += 10
    decode.handoffs.poll()
    assert decode.receiver.aborted == ["r/part1"] and decode.handoffs.num_pending() == 0
    decode.handoffs.poll()  # the aborted fetch is reported: only now are the pages free
    assert decode.num_free == NUM_PAGES
    # A handed-off prompt never expires, however long its fetch takes (the receiver's timeout
    # ends it).
    decode.handoffs.accept_handoff(handoff("s"))
    decode.clock.now += 10 * PARTS_TIMEOUT_S
    decode.handoffs.poll()
    assert decode.handoffs.num_pending() == 1 and decode.receiver.aborted == ["r/part1"]


def test_a_stray_part_holds_only_its_own_pages_and_not_for_its_claimed_lease(decode):
    """A part from no prefill worker that expects it (a stranger on an open socket, a sender
    gone astray): it claims a prompt as long as the context and an hour's lease. It reserves
    the pages it offers, and gives them back after PARTS_TIMEOUT_S at the latest."""
    claim = part("x", 0, 0, 2, prompt=[5] * 250)
    claim.transfer = replace(claim.transfer, lease_deadline=time.time() + 3600)
    decode.handoffs.accept_part(claim)
    assert decode.num_free == NUM_PAGES - 2
    decode.receiver.complete("x/part0")
    decode.clock.now += PARTS_TIMEOUT_S - 1
    decode.handoffs.poll()
    assert decode.handoffs.num_pending() == 1
    decode.clock.now += 2
    decode.handoffs.poll()
    assert decode.handoffs.num_pending() == 0 and decode.num_free == NUM_PAGES
    # One that cannot be fetched gives its pages back when the fetch ends, not at its deadline.
    decode.handoffs.accept_part(part("y", 0, 0, 2))
    decode.receiver.fail("y/part0", "no sender answered")
    decode.handoffs.poll()
    assert decode.handoffs.num_pending() == 0 and decode.num_free == NUM_PAGES
    # Its handoff, if one comes after all, has the prompt prefilled here.
    decode.handoffs.accept_handoff(handoff("y", first_page=2, num_parts=1))
    assert decode.waiting("y").num_computed_tokens == 0
    # A part past the end its own part 0 claimed is refused, and the parts dropped.
    decode.handoffs.accept_part(part("z", 0, 0, 2, prompt=PROMPT[:40]))  # three pages
    decode.handoffs.accept_part(part("z", 1, 2, 2, prompt=PROMPT[:40]))
    decode.handoffs.poll()
    assert decode.receiver.aborted == ["z/part0"] and decode.handoffs.num_pending() == 0
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES


def test_a_duplicate_or_known_handoff_is_refused_before_anything_is_reserved(decode):
    decode.handoffs.accept_handoff(handoff("r"))
    free = decode.num_free
    decode.handoffs.accept_handoff(handoff("r"))  # a second handoff
    decode.handoffs.accept_part(part("r", 0, 0, 2))  # a part after the handoff
    assert decode.num_free == free and len(decode.receiver.started) == 1
    # A request the scheduler already serves (the router re-dispatched it here).
    assert decode.worker.admit(Sequence.from_prompt("s", PROMPT, GREEDY))
    decode.handoffs.accept_part(part("s", 0, 0, 2))
    decode.handoffs.accept_handoff(handoff("s"))
    # A part of a prompt whose part 0 was never taken: the handoff will offer every page.
    decode.handoffs.accept_part(part("t", 1, 2, 1))
    assert decode.num_free == free and len(decode.receiver.started) == 1
    assert decode.handoffs.num_pending() == 1 and not decode.worker.failures


def test_a_prompt_with_no_room_is_prefilled_here_without_reserving(decode):
    decode.handoffs.accept_handoff(handoff("r"))
    fallbacks, free = sample(FALLBACKS), decode.num_free
    big = random_prompts(1, seed=2, min_len=16 * free + 1, max_len=16 * free + 1)[0]
    decode.handoffs.accept_part(part("big", 0, 0, 2, prompt=big))  # its own two pages
    assert decode.handoffs.num_pending() == 2 and decode.num_free == free - 2
    decode.handoffs.accept_handoff(handoff("big", prompt=big, first_page=2, num_parts=1))
    assert decode.receiver.aborted == ["big/part0"] and len(decode.receiver.started) == 2
    assert decode.waiting("big").num_computed_tokens == 0
    assert sample(FALLBACKS) == fallbacks + 1 and not decode.worker.failures
    decode.handoffs.poll()
    assert decode.num_free == free and decode.handoffs.num_pending() == 1


def test_messages_beyond_the_workers_limits_are_refused_before_dispatch():
    vocab, max_len = 384, 256
    good = handoff("r")
    assert size_problem(good, vocab, max_len) is None
    assert size_problem(part("r", 0, 0, 2), vocab, max_len) is None
    too_long = handoff("r", prompt=[5] * max_len)
    assert "256-token prompt" in size_problem(too_long, vocab, max_len)
    past_vocab = handoff("r", prompt=[vocab, *PROMPT])
    assert "outside the vocabulary" in size_problem(past_vocab, vocab, max_len)
    bad_first = handoff("r")
    bad_first.first_token = TokenSample(-1)
    assert "outside the vocabulary" in size_problem(bad_first, vocab, max_len)
    huge_part = part("r", 0, 0, 2, prompt=[5] * 10**6)
    assert "1000000-token prompt" in size_problem(huge_part, vocab, max_len)
    assert "negative" in size_problem(part("r", -1, 0, 2), vocab, max_len)
    cached = handoff("r")
    cached.num_cached_tokens = len(PROMPT) + 1
    assert "cached tokens" in size_problem(cached, vocab, max_len)


def test_parts_that_do_not_add_up_are_dropped_and_the_prompt_is_prefilled_here(decode):
    fallbacks = sample(FALLBACKS)
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    decode.handoffs.accept_part(part("r", 2, 3, 1))  # part 1 went missing
    assert [transfer_id for transfer_id, _ in decode.receiver.started] == ["r/part0"]
    decode.handoffs.accept_handoff(handoff("r", first_page=4, num_parts=3))
    assert decode.receiver.aborted == ["r/part0"] and len(decode.receiver.started) == 1
    assert decode.waiting("r").num_computed_tokens == 0
    assert sample(FALLBACKS) == fallbacks + 1
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES
    # In order here, but the handoff counts a part that never came.
    decode.handoffs.accept_part(part("s", 0, 0, 2))
    decode.handoffs.accept_handoff(handoff("s", first_page=3, num_parts=2))
    assert decode.receiver.aborted == ["r/part0", "s/part0"]
    assert [transfer_id for transfer_id, _ in decode.receiver.started] == ["r/part0", "s/part0"]
    assert decode.waiting("s").num_computed_tokens == 0
    assert sample(FALLBACKS) == fallbacks + 2
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES


def test_a_handoff_offering_every_page_replaces_the_parts(decode):
    decode.handoffs.accept_part(part("r", 0, 0, 2))
    [(_, part_dst)] = decode.receiver.started
    decode.handoffs.accept_handoff(handoff("r"))  # first_page 0: the parts broke over there
    assert decode.receiver.aborted == ["r/part0"]
    assert decode.num_free == NUM_PAGES - 7  # the part's pages until its fetch ends
    decode.handoffs.poll()
    assert decode.num_free == NUM_PAGES - 5
    decode.receiver.complete("r")
    decode.handoffs.poll()
    seq = decode.waiting("r")
    assert seq.num_computed_tokens == len(PROMPT) and not set(part_dst) & set(seq.page_ids)
