"""Live role switches, the worker's side, in-process on a real engine (the tiny model): the
loop's pieces driven by hand (``_on_switch_role``, ``turn``, ``_try_switch``), what goes to the
router recorded. A switch refused, or failed midway (a drain that runs out of time, a new role
that cannot be built), leaves the worker serving its old role with its old scheduler, and a
request served after it gets the one-process engine's greedy tokens; a switch done keeps the
engine (weights, pool, page manager) and hands it to the new role with every page free.

The whole path, real processes under a stream of requests through the router, is in
``test_role_switch_cluster.py``.
"""

from __future__ import annotations

import time

import pytest
from tiny_models import build_tiny_model, random_prompts

from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import DecodeScheduler, PrefillScheduler
from common.engine.sequence import Sequence
from common.protocol import (
    SWITCH_FAILED,
    SWITCH_REFUSED,
    DecodeRequest,
    RoleSwitchResult,
    SwitchRole,
)
from common.sampling_params import SamplingParams
from common.service.role_switch import switch_problem
from decode_worker.main import ROLES
from decode_worker.worker import DecodeWorker, build_parser
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.slow  # builds engines: seconds each

DEADLINE_S = 120.0
PROMPTS = random_prompts(3, seed=11, min_len=20, max_len=40)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("llama3-rope", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(model=str(model), dtype="float32", device="cpu",
                     scheduler=SchedulerConfig(max_model_len=512))
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate(PROMPTS, params)


def make_worker(model, *flags: str) -> tuple[DecodeWorker, list]:
    """A decode worker never registered (no router), what it sends recorded instead."""
    args = build_parser().parse_args(
        [
            "--router", "tcp://127.0.0.1:1", "--host", "127.0.0.1", "--model", str(model),
            "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--max-model-len", "512", "--metrics-port", "0", *flags,
        ]
    )  # fmt: skip
    worker = DecodeWorker(args)
    worker.roles = dict(ROLES)
    sent: list = []
    worker.link._send_now = sent.append  # type: ignore[method-assign]
    worker.start_step_io()
    return worker, sent


@pytest.fixture
def worker(model):
    worker, sent = make_worker(model)
    yield worker, sent
    worker._step_io.close()
    worker.close()


def submit(worker, index: int) -> Sequence:
    """PROMPTS[index] as the router sends a short prompt: prefilled and decoded here."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    worker.handle(DecodeRequest(f"r{index}", PROMPTS[index], params))
    return worker.scheduler.waiting[-1]


def run_until(worker, done, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, what
        worker.turn()


def results(sent: list) -> list[RoleSwitchResult]:
    return [msg for msg in sent if isinstance(msg, RoleSwitchResult)]


def all_pages_free(worker) -> bool:
    pages = worker.page_manager
    return pages.num_free_pages == pages.num_pages


def test_switch_problems_name_each_reason():
    base = dict(allowed=True, buildable=True, tensor_parallel_size=1, speculative=False,
                draining=False, switching=False)  # fmt: skip
    assert switch_problem("prefill", "decode", **base) is None
    cases = {
        "already": ("decode", {}),
        "--no-role-switch": ("prefill", {"allowed": False}),
        "cannot build": ("prefill", {"buildable": False}),
        "tensor-parallel": ("prefill", {"tensor_parallel_size": 2}),
        "speculative": ("prefill", {"speculative": True}),
        "draining": ("prefill", {"draining": True}),
        "switching already": ("prefill", {"switching": True}),
    }
    for words, (role, change) in cases.items():
        problem = switch_problem(role, "decode", **{**base, **change})
        assert problem is not None and words in problem, (words, problem)


def test_a_drain_that_runs_out_of_time_leaves_the_old_role_serving(worker, expected):
    worker, sent = worker
    scheduler = worker.scheduler
    seq = submit(worker, 0)
    worker._on_switch_role(SwitchRole("switch-1", "prefill", 0.05))
    assert worker.role_switch is not None
    time.sleep(0.1)  # past the switch's drain timeout, with the request still held
    assert worker._try_switch(worker.role_switch) is False
    [result] = results(sent)
    assert result.outcome == SWITCH_FAILED and result.role == "decode"
    assert "drain timeout: 1 requests" in (result.error or "")
    assert worker.role_switch is None and worker.successor is None
    assert worker.scheduler is scheduler and worker.engine.scheduler is scheduler
    # The request it held finishes here, as the one-process engine computes it, and so does
    # one that comes after.
    later = submit(worker, 1)
    run_until(worker, lambda: seq.finish_reason and later.finish_reason, "requests finish")
    assert seq.token_ids[len(PROMPTS[0]) :] == expected[0]
    assert later.token_ids[len(PROMPTS[1]) :] == expected[1]
    assert all_pages_free(worker)


def test_a_new_role_that_fails_to_build_leaves_the_old_role_serving(worker, expected, monkeypatch):
    worker, sent = worker
    scheduler, handoff_endpoint = worker.scheduler, worker.handoff_endpoint

    def broken(self, args, host=None):
        raise OSError("no port for the KV sender")

    monkeypatch.setattr(PrefillWorker, "__init__", broken)
    worker._on_switch_role(SwitchRole("switch-2", "prefill", 30.0))
    assert worker._try_switch(worker.role_switch) is False
    [result] = results(sent)
    assert result.outcome == SWITCH_FAILED and result.role == "decode"
    assert "no port for the KV sender" in (result.error or "")
    assert worker.engine.scheduler is scheduler and isinstance(scheduler, DecodeScheduler)
    assert worker.engine.role == "decode" and not worker.handoff_socket.closed
    assert worker.handoff_endpoint == handoff_endpoint
    seq = submit(worker, 2)
    run_until(worker, lambda: seq.finish_reason, "the request finishes")
    assert seq.token_ids[len(PROMPTS[2]) :] == expected[2]
    assert all_pages_free(worker)


def test_refused_switches_change_nothing(model, worker):
    worker, sent = worker
    worker._on_switch_role(SwitchRole("switch-3", "decode", 30.0))
    worker.roles = {"decode": DecodeWorker}  # a process that cannot build the other role
    worker._on_switch_role(SwitchRole("switch-4", "prefill", 30.0))
    refused = results(sent)
    assert [r.outcome for r in refused] == [SWITCH_REFUSED] * 2
    assert "serves as decode already" in (refused[0].error or "")
    assert "cannot build a prefill worker" in (refused[1].error or "")
    assert worker.role_switch is None and worker.engine.role == "decode"
    # The flag that keeps a worker in its role, and a speculative decoder.
    for flags, words in (
        (("--no-role-switch",), "--no-role-switch"),
        (("--speculative-method", "ngram"), "speculative decoding"),
    ):
        other, other_sent = make_worker(model, *flags)
        try:
            other._on_switch_role(SwitchRole("switch-5", "prefill", 30.0))
            [result] = results(other_sent)
            assert result.outcome == SWITCH_REFUSED and words in (result.error or ""), result
            assert other.role_switch is None
        finally:
            other._step_io.close()
            other.close()


def test_a_switch_hands_the_same_engine_to_the_new_role_with_every_page_free(model, expected):
    worker, sent = make_worker(model)
    engine, pool, pages = worker.engine, worker.engine.pool, worker.page_manager
    seq = submit(worker, 0)
    worker._on_switch_role(SwitchRole("switch-6", "prefill", 60.0))
    # It serves what it holds first: no switch while the request runs.
    assert worker._try_switch(worker.role_switch) is False and not results(sent)
    run_until(worker, lambda: seq.finish_reason, "the request finishes")
    worker.link.flush()
    assert seq.token_ids[len(PROMPTS[0]) :] == expected[0]
    assert pages.num_cached_pages() > 0  # its prompt's pages stay in the prefix cache
    assert worker._try_switch(worker.role_switch) is True
    successor = worker.successor
    worker._step_io.close()
    worker.close_role()
    try:
        assert isinstance(successor, PrefillWorker)
        assert successor.engine is engine and successor.engine.pool is pool
        assert successor.page_manager is pages and all_pages_free(successor)
        assert isinstance(engine.scheduler, PrefillScheduler) and engine.role == "prefill"
        assert successor.scheduler is engine.scheduler
        assert successor.worker_id == worker.worker_id
        assert successor.incarnation == worker.incarnation
        assert successor.roles == worker.roles
        result = successor.switch_result
        assert result is not None and result.role == "prefill" and result.error is None
        assert worker.handoff_socket.closed  # the decode role's own sockets went with it
        # Its prefix cache came along: the new role reports it when it registers.
        assert successor.registration().role == "prefill"
    finally:
        successor.close()
