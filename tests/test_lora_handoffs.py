"""A decode worker takes a handoff's KV only under the adapter it was computed under: one it
does not hold, or holds with other weights, is refused, logged and failed to the router, its
pages given back and nothing computed (decode_worker/handoffs.py, driven as in
test_handoffs.py); and a worker loads and unloads adapters as the router asks, refusing to
unload one a request it holds computes under."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import pytest
from engines import build_engine
from fake_transfer import FakeReceiver
from test_handoffs import NUM_PAGES, Clock, WorkerSide, handoff
from tiny_loras import save_tiny_lora
from tiny_models import save_tiny_model, tiny_llama_config

from common.config import LoraConfig
from common.engine import lora as lora_manager_module
from common.engine.llm_engine import LLMEngine
from common.lora_adapters import adapter_namespace
from common.protocol import AdapterResult, LoadAdapter, UnloadAdapter
from common.sampling_params import SamplingParams
from common.service.worker_base import WorkerService
from decode_worker.handoffs import Handoffs


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-handoff")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    return base, save_tiny_lora(base, root / "sql", seed=1, rank=4)


def decode_side(base, modules):
    lora = LoraConfig(enable_lora=True, modules=modules) if modules is not None else None
    engine = build_engine(base, num_pages=NUM_PAGES, max_model_len=256, role="decode", lora=lora)
    receiver, worker = FakeReceiver(engine.pool), WorkerSide(engine)
    handoffs = Handoffs(
        receiver,
        engine.scheduler,
        checked_params=worker.checked_params,
        admit=worker.admit,
        fail=worker.fail,
        fetch_timeout=10.0,
        clock=Clock(),
        adapter_namespace=engine.adapter_namespace if engine.lora is not None else None,
    )
    return engine, receiver, worker, handoffs


def test_a_handoff_under_a_held_adapter_is_fetched_and_filed_in_its_namespace(lora_model):
    base, sql = lora_model
    engine, receiver, worker, handoffs = decode_side(base, {"sql": str(sql)})
    namespace = adapter_namespace("sql", sql)
    handoffs.accept_handoff(replace(handoff("r"), lora_name="sql", cache_namespace=namespace))
    assert not worker.failures and len(receiver.started) == 1
    receiver.complete("r")
    handoffs.poll()
    [seq] = [s for s in engine.scheduler.waiting if s.request_id == "r"]
    assert (seq.lora_name, seq.cache_namespace) == ("sql", namespace)
    # Its shipped pages are filed under the adapter's namespace, and it decodes under it.
    [output] = engine.step()
    assert output.request_id == "r" and len(output.new_samples) == 1
    assert engine.lora.on_device() == ["sql"]
    assert engine.page_manager.match_prefix(seq.prompt_token_ids, None, namespace)
    assert not engine.page_manager.match_prefix(seq.prompt_token_ids, None, "")


@pytest.mark.parametrize(
    "modules, lora_name, namespace, message",
    [
        (None, "sql", "lora:sql:x", "serves no LoRA adapters"),
        ({}, "sql", "lora:sql:x", "'sql' does not exist"),
        ("held", "sql", "lora:sql:0000", "with other weights"),
        ("held", None, "lora:sql:x", "a base-model handoff in cache namespace"),
    ],
)
def test_a_handoff_under_an_adapter_not_held_is_refused(
    lora_model, modules, lora_name, namespace, message
):
    base, sql = lora_model
    held = {"sql": str(sql)} if modules == "held" else modules
    engine, receiver, worker, handoffs = decode_side(base, held)
    handoffs.accept_handoff(replace(handoff("r"), lora_name=lora_name, cache_namespace=namespace))
    [failure] = worker.failures
    assert failure.request_id == "r" and not failure.retryable and message in failure.error
    assert not receiver.started and handoffs.num_pending() == 0
    assert engine.page_manager.num_free_pages == NUM_PAGES
    assert not engine.scheduler.holds("r")


@dataclass
class SentMessages:
    sent: list = field(default_factory=list)

    def send(self, msg) -> None:
        self.sent.append(msg)


@dataclass
class AdapterSide:
    """What a worker's LoadAdapter and UnloadAdapter handling reaches: WorkerService's own."""

    engine: LLMEngine
    worker_id: str = "decode-0"
    link: SentMessages = field(default_factory=SentMessages)

    _update = WorkerService._update
    _refuse_update = WorkerService._refuse_update
    _answer_adapter_loads = WorkerService._answer_adapter_loads
    adapter_users = WorkerService.adapter_users

    @property
    def scheduler(self):
        return self.engine.scheduler

    def ask(self, msg: LoadAdapter | UnloadAdapter) -> str | None:
        """Send ``msg`` and wait (bounded) for its answer, as the worker's loop would."""
        self._update(msg)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for answer in self.link.sent:
                if answer.operation_id == msg.operation_id:
                    assert isinstance(answer, AdapterResult)
                    return answer.error
            self._answer_adapter_loads()
            time.sleep(0.001)
        raise AssertionError(f"{msg.operation_id} was never answered")


def test_a_worker_loads_refuses_and_unloads_adapters_as_the_router_asks(lora_model, tmp_path):
    base, sql = lora_model
    engine = build_engine(
        base, num_pages=NUM_PAGES, max_model_len=256, lora=LoraConfig(enable_lora=True)
    )
    side = AdapterSide(engine)
    assert side.ask(LoadAdapter("op1", "sql", str(sql))) is None
    assert side.ask(LoadAdapter("op2", "sql", str(sql))) is None  # the same: done already
    assert "already loaded" in side.ask(LoadAdapter("op3", "sql", str(tmp_path)))
    assert "no such folder" in side.ask(LoadAdapter("op4", "x", str(tmp_path / "gone")))
    assert engine.lora.names == ["sql"]
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=2), lora_name="sql")
    assert "in use by 1 requests" in side.ask(UnloadAdapter("op5", "sql"))
    while engine.has_unfinished:
        engine.step()
    assert side.ask(UnloadAdapter("op6", "sql")) is None
    assert engine.lora.names == [] and "is not loaded" in side.ask(UnloadAdapter("o7", "sql"))
    plain = AdapterSide(build_engine(base, num_pages=NUM_PAGES, max_model_len=256))
    assert "serves no LoRA adapters" in plain.ask(LoadAdapter("op8", "sql", str(sql)))


def test_a_runtime_load_is_read_while_the_engine_steps(lora_model, monkeypatch):
    """The load's files are read on the reader thread (held there until the test lets it go):
    the base model's request steps to its end meanwhile, and the load is answered after."""
    base, sql = lora_model
    engine = build_engine(
        base, num_pages=NUM_PAGES, max_model_len=256, lora=LoraConfig(enable_lora=True)
    )
    side = AdapterSide(engine)
    let_go = threading.Event()
    real_load = lora_manager_module.load_adapter

    def held_load(*args, **kwargs):
        assert let_go.wait(timeout=60), "the test never let the read go"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(lora_manager_module, "load_adapter", held_load)
    side._update(LoadAdapter("op1", "sql", str(sql)))
    side._update(LoadAdapter("op2", "sql", str(sql)))  # the same load, asked again meanwhile
    assert "being loaded" in side.ask(LoadAdapter("op3", "sql", "/elsewhere"))
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_unfinished and steps < 100:
        engine.step()
        side._answer_adapter_loads()
        steps += 1
    assert not engine.has_unfinished
    assert [m.operation_id for m in side.link.sent] == ["op3"] and engine.lora.names == []
    let_go.set()
    deadline = time.monotonic() + 60
    while len(side.link.sent) < 3 and time.monotonic() < deadline:
        side._answer_adapter_loads()
        time.sleep(0.001)
    assert [(m.operation_id, m.error) for m in side.link.sent[1:]] == [("op1", None), ("op2", None)]
    assert engine.lora.names == ["sql"]
