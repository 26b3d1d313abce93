"""The prefill side's shipping books (prefill_worker/shipments.py), driven in-process: a real
prefill engine computes the prompts, a fake transfer (fake_transfer.py) stands in for the KV
sender, and pushes to decode workers land in a list. The last test carries the pages to a real
decode engine through ``Handoffs`` and checks the tokens. No processes, no sockets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import pytest
from engines import build_engine
from fake_transfer import FakeReceiver, FakeSender
from prometheus_client import REGISTRY
from tiny_models import build_tiny_model, random_prompts

from common.engine.llm_engine import LLMEngine
from common.engine.sequence import Sequence
from common.messages import Message
from common.protocol import AbortRequest, Handoff, HandoffPart, PrefillRequest, RequestFailed
from common.sampling_params import SamplingParams
from common.service.worker_base import WorkerService
from decode_worker.handoffs import Handoffs
from prefill_worker.shipments import Shipments

NUM_PAGES = 32
CHUNK = 24  # tokens a prefill step computes: a 70-token prompt takes three steps
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = random_prompts(1, seed=3, min_len=70, max_len=70)[0]  # five pages of 16
ENDPOINT = "tcp://decode:1"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("model"))


def make_engine(model, role: str | None) -> LLMEngine:
    return build_engine(
        model, num_pages=NUM_PAGES, max_num_batched_tokens=CHUNK, max_model_len=256, role=role
    )


@dataclass
class Prefill:
    """A prefill engine and its ``Shipments``; pushes and failures land in lists."""

    engine: LLMEngine
    sender: FakeSender
    pushed: list[tuple[str, Message]] = field(default_factory=list)
    failures: list[RequestFailed] = field(default_factory=list)
    refuse: set[type] = field(default_factory=set)  # message types the decode worker drops
    shipments: Shipments = field(init=False)

    def __post_init__(self) -> None:
        self.shipments = Shipments(
            self.sender,
            self.engine.page_manager,
            release=self.engine.scheduler.release,
            push=self.push,
            fail=self.fail,
            lease_seconds=30.0,
        )

    def push(self, endpoint: str, msg: Message) -> bool:
        if type(msg) in self.refuse:
            return False
        self.pushed.append((endpoint, msg))
        return True

    def fail(self, request_id: str, error: str, retryable: bool) -> None:
        self.failures.append(RequestFailed(request_id, error, retryable))

    def submit(self, request_id: str, prompt=PROMPT, params=GREEDY) -> Sequence:
        """As the worker admits a PrefillRequest."""
        seq = Sequence.from_prompt(request_id, prompt, params)
        self.engine.scheduler.add(seq)
        self.shipments.expect(PrefillRequest(request_id, prompt, params, "d", ENDPOINT))
        return seq

    def step(self) -> float:
        """One engine step, reported as the worker reports it; returns its end time."""
        batch = self.engine.scheduler.schedule()
        outputs = self.engine.scheduler.postprocess(batch, self.engine.runner.run(batch))
        done_at = time.time()
        for out in outputs:
            if out.left_batch:
                self.shipments.on_first_token(out.seq, done_at)
        self.shipments.ship_parts([item.seq for item in batch])
        return done_at

    def messages(self, kind: type = object) -> list:
        return [msg for _, msg in self.pushed if isinstance(msg, kind)]

    def refs(self, pages: list[int]) -> list[int]:
        return [self.engine.page_manager.ref_count(page) for page in pages]


@pytest.fixture
def prefill(model) -> Prefill:
    engine = make_engine(model, "prefill")
    return Prefill(engine, FakeSender(engine.pool))


def sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


SENT = "pdserve_kv_pages_sent_total"
HANDED_OFF = ("pdserve_requests_total", {"outcome": "handed_off"})


def test_each_chunk_ships_its_finished_pages_then_the_handoff_offers_the_rest(prefill):
    sent, handed_off = sample(SENT), sample(*HANDED_OFF)
    seq = prefill.submit("r")
    prefill.step()  # 24 tokens: page 0 is final
    [(endpoint, first)] = prefill.pushed
    assert endpoint == ENDPOINT and isinstance(first, HandoffPart)
    assert (first.request_id, first.part_index, first.first_page) == ("r", 0, 0)
    assert first.num_prompt_tokens == len(PROMPT) and first.transfer_id == "r/part0"
    assert first.transfer.page_ids == seq.page_ids[:1]
    assert prefill.refs(seq.page_ids[:1]) == [2]  # the sequence's, and the lease's own
    prefill.step()  # 48 tokens: pages 1 and 2
    second = prefill.pushed[1][1]
    assert (second.part_index, second.first_page, second.transfer_id) == (1, 1, "r/part1")
    assert second.transfer.page_ids == seq.page_ids[1:3]
    assert prefill.shipments.num_handed_off() == 0
    done_at = prefill.step()  # the last 22 tokens and the first token

    assert [type(msg) for _, msg in prefill.pushed] == [HandoffPart, HandoffPart, Handoff]
    handoff = prefill.pushed[2][1]
    assert prefill.pushed[2][0] == ENDPOINT
    assert handoff.request_id == "r" and handoff.prompt_token_ids == PROMPT
    assert handoff.params == GREEDY and handoff.prefill_done_at == done_at
    assert handoff.first_token.token_id == seq.samples[0].token_id
    assert (handoff.first_page, handoff.num_parts, handoff.num_cached_tokens) == (3, 2, 0)
    assert handoff.transfer.page_ids == seq.page_ids[3:5]
    assert set(prefill.sender.published) == {"r/part0", "r/part1", "r"}
    assert prefill.shipments.num_handed_off() == 1
    assert sample(SENT) == sent + 5 and sample(*HANDED_OFF) == handed_off + 1
    # No part after the handoff, however many steps follow.
    prefill.shipments.ship_parts([seq])
    assert len(prefill.pushed) == 3


def test_pages_are_freed_only_when_every_lease_on_them_has_ended(prefill):
    seq = prefill.submit("r")
    for _ in range(3):
        prefill.step()
    pages = list(seq.page_ids)
    assert prefill.refs(pages) == [2, 2, 2, 1, 1]
    prefill.sender.release("r")  # the decode worker has the handoff's pages
    prefill.shipments.poll()
    assert prefill.refs(pages) == [1, 1, 1, 0, 0] and prefill.shipments.num_handed_off() == 0
    prefill.sender.release("r/part1")
    prefill.shipments.poll()
    assert prefill.refs(pages) == [1, 0, 0, 0, 0]
    prefill.sender.release("r/part0")
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES


def test_an_abort_while_prefilling_withdraws_the_parts(prefill):
    seq = prefill.submit("r")
    prefill.step()
    prefill.step()
    pages = list(seq.page_ids)
    # The worker's abort path: the shipments first, then the scheduler.
    prefill.shipments.withdraw("r")
    assert prefill.engine.scheduler.abort("r") is not None
    assert prefill.sender.aborted == ["r/part0", "r/part1"]
    assert prefill.pushed[-1] == (ENDPOINT, AbortRequest("r"))
    assert prefill.refs(pages[:3]) == [1, 1, 1]  # the parts' leases hold them until poll
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES
    prefill.shipments.withdraw("r")  # again: nothing left to withdraw
    prefill.shipments.ship_parts([seq])
    assert len(prefill.messages(AbortRequest)) == 1 and len(prefill.pushed) == 3


def test_an_abort_before_any_part_went_out_tells_no_decode_worker(prefill):
    prefill.submit("r", prompt=PROMPT[:10])
    prefill.shipments.withdraw("r")
    assert prefill.pushed == [] and prefill.sender.aborted == []


def test_a_first_token_that_ends_the_request_withdraws_its_parts(prefill):
    prefill.submit("r", params=SamplingParams(max_tokens=1, temperature=0.0))
    for _ in range(3):
        prefill.step()
    assert [type(msg) for msg in prefill.messages()] == [HandoffPart, HandoffPart, AbortRequest]
    assert prefill.sender.aborted == ["r/part0", "r/part1"]
    assert prefill.shipments.num_handed_off() == 0
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES


def test_an_abort_after_the_handoff_ends_its_lease(prefill):
    prefill.submit("r", prompt=PROMPT[:20])  # one step, so no parts
    prefill.step()
    [handoff] = prefill.messages()
    assert isinstance(handoff, Handoff) and (handoff.first_page, handoff.num_parts) == (0, 0)
    assert prefill.engine.scheduler.abort("r") is None  # no longer the scheduler's
    prefill.shipments.abort_handoff("r")
    prefill.shipments.abort_handoff("unknown")
    assert prefill.sender.aborted == ["r"]
    assert prefill.engine.page_manager.num_free_pages < NUM_PAGES
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES
    assert prefill.shipments.num_handed_off() == 0


def test_an_unreachable_decode_worker_fails_the_request_retryable(prefill):
    sent = sample(SENT)
    prefill.refuse.add(Handoff)
    prefill.submit("r")
    for _ in range(3):
        prefill.step()
    [failure] = prefill.failures
    assert failure == RequestFailed("r", "decode worker d unreachable", True)
    assert prefill.sender.aborted == ["r", "r/part0", "r/part1"]
    assert [type(msg) for msg in prefill.messages()] == [HandoffPart, HandoffPart, AbortRequest]
    assert sample(SENT) == sent + 3  # the parts went out; the handoff's pages did not
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES


def test_a_part_that_cannot_go_out_stops_the_parts_and_the_handoff_offers_every_page(prefill):
    prefill.refuse.add(HandoffPart)
    seq = prefill.submit("r")
    for _ in range(3):
        prefill.step()
    [handoff] = prefill.messages()
    assert (handoff.first_page, handoff.num_parts) == (0, 0)
    assert handoff.transfer.page_ids == seq.page_ids
    assert prefill.sender.aborted == ["r/part0"]  # published, then taken back; no retry


def test_a_part_that_cannot_be_published_stops_the_parts(prefill):
    prefill.sender.publish("r/part0", [NUM_PAGES - 1], 30.0)  # an id that collides
    seq = prefill.submit("r")
    for _ in range(3):
        prefill.step()
    [handoff] = prefill.messages()
    assert (handoff.first_page, handoff.num_parts) == (0, 0)
    assert handoff.transfer.page_ids == seq.page_ids
    assert sorted(prefill.sender.published) == ["r", "r/part0"]


def test_a_handoff_that_cannot_be_published_fails_retryable_and_frees_the_pages(prefill):
    """A tensor-parallel rank that does not publish makes publish raise: the parts are taken
    back, the request fails retryable, and its pages come back."""
    prefill.sender.publish("r", [NUM_PAGES - 1], 30.0)  # an id that collides
    prefill.submit("r")
    for _ in range(3):
        prefill.step()
    [failure] = prefill.failures
    assert failure.retryable and "could not be published" in failure.error
    assert [type(msg) for msg in prefill.messages()] == [HandoffPart, HandoffPart, AbortRequest]
    assert prefill.sender.aborted == ["r/part0", "r/part1"]
    prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES


def test_pages_shipped_in_parts_decode_to_the_tokens_of_one_process(prefill, model):
    """Both sides' books together: a prompt shipped in parts and a handoff, its pages copied by
    the fake transfer into a decode engine, decodes to the one-process engine's tokens."""
    expected = make_engine(model, None).generate([PROMPT], GREEDY)[0]
    decode = make_engine(model, "decode")
    receiver = FakeReceiver(decode.pool, sender=prefill.sender)
    failures: list[RequestFailed] = []
    # The decode worker's own checked_params and admit, its router link a list of failures.
    side = SimpleNamespace(
        engine=decode,
        scheduler=decode.scheduler,
        fail=lambda *args: failures.append(RequestFailed(*args)),
    )
    handoffs = Handoffs(
        receiver,
        decode.scheduler,
        checked_params=partial(WorkerService.checked_params, side),
        admit=partial(WorkerService.admit, side),
        fail=side.fail,
        fetch_timeout=10.0,
    )
    prefill.submit("r")
    while prefill.engine.scheduler.has_work:
        prefill.step()
        for _, msg in prefill.pushed:
            if isinstance(msg, Handoff):
                handoffs.accept_handoff(msg)
            else:
                handoffs.accept_part(msg)
        prefill.pushed.clear()
        for transfer_id in list(receiver.in_flight):
            receiver.complete(transfer_id)
        handoffs.poll()
        prefill.shipments.poll()
    assert prefill.engine.page_manager.num_free_pages == NUM_PAGES  # every lease ended
    assert handoffs.num_pending() == 0 and not failures
    [seq] = decode.scheduler.waiting
    while decode.scheduler.has_work:
        batch = decode.scheduler.schedule()
        decode.scheduler.postprocess(batch, decode.runner.run(batch))
    assert seq.output_token_ids == expected
    assert decode.scheduler.num_prompt_tokens_computed == 0
