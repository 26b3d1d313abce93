"""Graceful drain: SIGTERM makes a worker stop taking work, finish or hand off what it holds,
and exit 0 within --drain-timeout, with no request lost.

The fast tests drive the pieces (the messages, the router's dispatcher, ``Drain`` on a fake
clock, the worker's probes); the slow one signals real worker processes under a stream of
requests and compares every answer with the one-process engine's greedy tokens.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from cluster_harness import reference_engine
from test_router_registry import beat, reg
from tiny_models import build_tiny_chat_model

from benchmarks.harness import free_port_pair
from common.messages import decode, encode
from common.protocol import (
    AbortRequest,
    DecodeRequest,
    LeaveAck,
    PrefillRequest,
    TokenDelta,
    TokenSample,
    WorkerDraining,
)
from common.sampling_params import SamplingParams
from common.service.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from common.service.health import Probes, serve_worker_http
from common.tokenizer import Tokenizer
from decode_worker.worker import build_parser as decode_parser
from prefill_worker.worker import build_parser as prefill_parser
from router.dispatcher import Dispatcher, Generation
from router.metrics import RouterMetrics
from router.policy import RoutingConfig
from router.registry import WorkerRegistry

# -- the messages ------------------------------------------------------------------------------


def test_drain_messages_round_trip_and_are_checked():
    for msg in (WorkerDraining("d-1"), WorkerDraining("d-1", leaving=True), LeaveAck("d-1")):
        assert decode(encode(msg)) == msg
    with pytest.raises(ValueError, match="leaving"):
        decode(encode(WorkerDraining("d-1", leaving="yes")))  # type: ignore[arg-type]


def test_drain_timeout_flag_parses_for_both_roles():
    base = ["--router", "tcp://127.0.0.1:1", "--model", "m"]
    for parser in (prefill_parser(), decode_parser()):
        assert parser.parse_args(base).drain_timeout == DEFAULT_DRAIN_TIMEOUT_S
        assert parser.parse_args([*base, "--drain-timeout", "7.5"]).drain_timeout == 7.5
        for bad in ("0", "-1", "inf", "nan", "soon"):
            with pytest.raises(SystemExit):
                parser.parse_args([*base, "--drain-timeout", bad])


# -- the router --------------------------------------------------------------------------------


class Sent:
    """The dispatcher's outbox."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, object]] = []

    def __call__(self, worker_id: str, msg) -> None:
        self.messages.append((worker_id, msg))

    def to(self, worker_id: str) -> list:
        return [msg for wid, msg in self.messages if wid == worker_id]


def two_of_each() -> tuple[Dispatcher, Sent, RouterMetrics]:
    registry = WorkerRegistry("m", heartbeat_timeout=30)
    now = time.monotonic()
    for worker_id, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                            ("d2", "decode")):  # fmt: skip
        assert registry.register(reg(worker_id, role), now) is None
        registry.on_heartbeat(beat(worker_id), now)
    sent, metrics = Sent(), RouterMetrics()
    routing = RoutingConfig(remote_prefill_min_tokens=0)
    return Dispatcher(registry, routing, metrics, sent, 3, 1.0), sent, metrics


def submit(dispatcher: Dispatcher, name: str) -> Generation:
    gen = Generation(name, list(range(40)), SamplingParams(max_tokens=8), asyncio.Queue(), 0)
    dispatcher.submit([gen])
    return gen


def test_a_draining_worker_gets_nothing_new_and_its_requests_move_when_it_leaves():
    dispatcher, sent, metrics = two_of_each()
    now = time.monotonic()
    running = submit(dispatcher, "running")
    holder = running.decode_worker
    other = "d2" if holder == "d1" else "d1"
    dispatcher.on_message(running.prefill_worker, delta(running, 0, 1, first=True), now)
    dispatcher.on_message(holder, delta(running, 1, 2), now)

    dispatcher.on_message(holder, WorkerDraining(holder), now)
    assert dispatcher.registry.workers[holder].describe()["draining"] is True
    for i in range(8):
        assert submit(dispatcher, f"new-{i}").decode_worker == other
    assert running.decode_worker == holder  # what it holds stays with it meanwhile
    assert not any(isinstance(m, AbortRequest) for m in sent.to(holder))

    dispatcher.on_message(holder, WorkerDraining(holder, leaving=True), now)
    assert holder not in dispatcher.registry.workers
    # Its sequence migrates with the three tokens it has, and the worker hears last that it
    # may go: after the abort of what it held.
    assert running.decode_worker == other and running.retries == 1
    migrated = [m for m in sent.to(other) if isinstance(m, DecodeRequest)]
    assert migrated[-1].request_id == running.wire_id
    assert migrated[-1].output_token_ids == [7, 7, 7]
    assert isinstance(sent.to(holder)[-1], LeaveAck)
    assert any(isinstance(m, AbortRequest) for m in sent.to(holder))
    # A drain is routine, not a removal (which alerts).
    assert metrics.registry.get_sample_value("pdserve_router_workers_removed_total") is None


def test_a_prefill_worker_leaving_with_prompts_has_them_dispatched_again():
    dispatcher, sent, _ = two_of_each()
    gen = submit(dispatcher, "queued")
    holder = gen.prefill_worker
    assert holder is not None
    dispatcher.on_message(holder, WorkerDraining(holder), time.monotonic())
    dispatcher.on_message(holder, WorkerDraining(holder, leaving=True), time.monotonic())
    other = "p2" if holder == "p1" else "p1"
    assert gen.prefill_worker == other
    assert [m.request_id for m in sent.to(other) if isinstance(m, PrefillRequest)] == [gen.wire_id]
    # An unknown worker that leaves is answered all the same: it need not wait.
    dispatcher.on_message("ghost", WorkerDraining("ghost", leaving=True), time.monotonic())
    assert sent.to("ghost") == [LeaveAck("ghost")]


def delta(gen: Generation, start: int, count: int, first: bool = False) -> TokenDelta:
    samples = [TokenSample(7) for _ in range(count)]
    return TokenDelta(gen.wire_id, samples, start_index=start, num_prompt_tokens=40, first=first)


# -- the worker's side -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeLink:
    """A RouterLink whose router answers a leave with ``answer`` (None: it is gone)."""

    def __init__(self, clock: FakeClock, answer: bool) -> None:
        self.sent: list = []
        self.clock = clock
        self.answer = answer
        self.socket = self

    def send(self, msg) -> None:
        self.sent.append(msg)

    def poll(self, timeout_ms: int) -> bool:
        if self.answer and self.sent and getattr(self.sent[-1], "leaving", False):
            return True
        self.clock.now += timeout_ms / 1000
        return False

    def receive(self) -> list:
        return [AbortRequest("r-1"), LeaveAck("w")]


def test_drain_serves_what_it_holds_until_the_timeout_then_leaves():
    clock = FakeClock()
    link = FakeLink(clock, answer=True)
    drain = Drain("w", timeout_s=10.0, clock=clock)
    assert not drain.poll(link, 3) and link.sent == []  # no SIGTERM yet
    drain.begin()
    assert not drain.poll(link, 3)
    assert link.sent == [WorkerDraining("w")]
    clock.now += 0.5
    assert not drain.poll(link, 3)
    clock.now += 0.6  # announced again once a second
    assert not drain.poll(link, 2)
    assert link.sent == [WorkerDraining("w")] * 2
    clock.now = 100.0 + 10.0 - drain.leave_wait_s  # the time kept for leaving has come
    assert drain.poll(link, 2)
    assert link.sent[-1] == WorkerDraining("w", leaving=True)
    assert clock.now == 108.0  # the router answered at once


def test_drain_leaves_as_soon_as_nothing_is_held_and_does_not_wait_for_a_gone_router():
    clock = FakeClock()
    link = FakeLink(clock, answer=False)
    drain = Drain("w", timeout_s=25.0, clock=clock)
    drain.begin()
    assert drain.poll(link, 0)
    assert link.sent == [WorkerDraining("w"), WorkerDraining("w", leaving=True)]
    assert clock.now == pytest.approx(100.0 + drain.leave_wait_s)
    with pytest.raises(ValueError):
        Drain("w", timeout_s=0)


def test_worker_http_serves_metrics_liveness_and_readiness():
    clock = FakeClock()
    probes = Probes(stall_s=60, clock=clock)
    url = serve_worker_http("127.0.0.1", 0, probes).removesuffix("/metrics")

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(url + path, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("/metrics") == 200
    assert b"pdserve_num_requests_running" in urllib.request.urlopen(url + "/metrics").read()
    assert (status("/health"), status("/ready")) == (200, 503)  # starting
    probes.turned(draining=False)
    assert (status("/health"), status("/ready")) == (200, 200)
    probes.turned(draining=True)
    assert (status("/health"), status("/ready")) == (200, 503)
    clock.now += 61  # the loop stopped turning
    assert (status("/health"), status("/ready")) == (503, 503)
    assert status("/nothing") == 404


# -- a cluster under load ----------------------------------------------------------------------

DRAIN_TIMEOUT_S = 2.0
# A drained worker has left (the router holds nothing of it) within its drain timeout, give or
# take a turn of its loop; its process is gone after the interpreter's teardown too, about a
# second for torch's alone here, several on a loaded machine.
LEAVE_SLACK_S = 1.0
EXIT_SLACK_S = 15.0
MIN_JOBS, MAX_JOBS = 24, 120
PROMPT = " ".join(f"item{i} is followed by item{i + 1}." for i in range(12))


class Cluster:
    """A router and its workers as processes started here (so their exit codes are ours)."""

    def __init__(self, folder: Path, logs: Path) -> None:
        self.folder, self.logs = folder, logs
        port = free_port_pair()
        self.base = f"http://127.0.0.1:{port}"
        self.control = f"tcp://127.0.0.1:{port + 1}"
        self.env = {**os.environ, "PDSERVE_CLUSTER_SECRET": "drain-test-secret"}
        self.processes: dict[str, subprocess.Popen] = {}
        self.start("router", "router", "--port", str(port), "--control", self.control,
                   "--model", str(folder), "--remote-prefill-min-tokens", "8",
                   "--heartbeat-timeout", "30", "--log-level", "info")  # fmt: skip

    def start(self, name: str, module: str, *args: str) -> None:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
            env={**self.env, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        log.close()

    def start_worker(self, worker_id: str, role: str, *args: str) -> None:
        self.start(worker_id, f"{role}_worker", "--router", self.control, "--worker-id",
                   worker_id, "--model", str(self.folder), "--dtype", "float32",
                   "--max-model-len", "1024", "--kv-cache-memory", "32MiB",
                   "--drain-timeout", str(DRAIN_TIMEOUT_S), *args)  # fmt: skip

    def workers(self) -> dict:
        return httpx.get(f"{self.base}/v1/workers", timeout=10).json()

    def wait_for(self, prefill: int, decode: int, deadline_s: float = 240) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                assert process.poll() is None, f"{name} exited:\n{self.log(name)}"
            try:
                listing = self.workers()
                if (len(listing["prefill"]), len(listing["decode"])) == (prefill, decode):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the cluster did not come up")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-4000:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def drain_cluster(tmp_path: Path) -> Iterator[Cluster]:
    folder = build_tiny_chat_model(tmp_path / "tiny-chat")
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(folder, logs)
    with ExitStack() as stack:
        stack.callback(cluster.stop)
        # Small prefill steps: a prompt stays on its prefill worker for several of them.
        for index in range(2):
            cluster.start_worker(f"prefill-{index}", "prefill", "--max-num-batched-tokens", "16")
            cluster.start_worker(f"decode-{index}", "decode")
        cluster.wait_for(prefill=2, decode=2)
        yield cluster


class Signaller(threading.Thread):
    """SIGTERMs a ``role`` worker that holds a request (by the router's books), polling while
    the stream of requests goes on: of those, the one with the most KV pages in use, which holds
    the longest sequences."""

    def __init__(self, cluster: Cluster, role: str, deadline_s: float = 120) -> None:
        super().__init__(name=f"sigterm-{role}", daemon=True)
        self.cluster, self.role, self.deadline_s = cluster, role, deadline_s
        self.worker_id: str | None = None
        self.at = self.wall_clock_at = 0.0

    def run(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            try:
                listing = self.cluster.workers()[self.role]
            except httpx.HTTPError:
                listing = []
            busy = [(w["num_pages"] - w["num_free_pages"], w["id"]) for w in listing
                    if w["load"]["inflight"] >= 1 and not w["draining"]]  # fmt: skip
            if busy:
                worker_id = max(busy)[1]
                self.cluster.processes[worker_id].send_signal(signal.SIGTERM)
                self.worker_id, self.at, self.wall_clock_at = (
                    worker_id,
                    time.monotonic(),
                    time.time(),
                )
                return
            time.sleep(0.005)


def left_at(cluster: Cluster, worker_id: str) -> float:
    """When the worker's log says it left (wall clock)."""
    found = re.search(r"^(\S+ \S+) INFO common.service.drain: drained; leaving$",
                      cluster.log(worker_id), re.MULTILINE)  # fmt: skip
    assert found, cluster.log(worker_id)
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def drain_report(cluster: Cluster, worker_id: str) -> tuple[int, int]:
    """From the logs: the requests the worker held at SIGTERM, and those the router moved."""
    held = re.search(r"draining: .*; (\d+) requests to finish", cluster.log(worker_id))
    moved = re.search(rf"worker {worker_id} \(\w+\) drained; (\d+) requests", cluster.log("router"))
    assert held and moved, (cluster.log(worker_id), cluster.log("router"))
    return int(held.group(1)), int(moved.group(1))


def complete(base: str, job: tuple[str, int]) -> dict:
    """The cluster's greedy completion of ``job`` (prompt, max_tokens), past any EOS."""
    prompt, max_tokens = job
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def greedy_answers(folder: Path, tokenizer: Tokenizer, jobs: list[tuple[str, int]]) -> list:
    """What the one-process engine answers each ``complete`` of ``jobs``: its greedy tokens."""
    engine = reference_engine(folder, max_model_len=1024)
    expected: list[list[int]] = [[] for _ in jobs]
    for max_tokens in {max_tokens for _, max_tokens in jobs}:
        picked = [i for i, job in enumerate(jobs) if job[1] == max_tokens]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = engine.generate([tokenizer.encode(jobs[i][0]) for i in picked], params)
        for i, tokens in zip(picked, outputs, strict=True):
            expected[i] = tokens
    return expected


@pytest.mark.slow
def test_sigterm_drains_a_worker_of_each_role_and_every_request_completes(tmp_path):
    """Under a stream of requests, SIGTERM one decode and one prefill worker while they hold
    requests (another of each stays up): both exit 0 soon after their drain timeout, and every
    request completes with the greedy tokens of the one-process engine. Short requests finish
    on the draining worker; a long generation (the signalled decode worker is the one with the
    most pages in use) outlasts its drain and migrates with its tokens so far. Which of these
    happened depends on timing: the report printed at the end counts them."""
    with drain_cluster(tmp_path) as cluster:
        tokenizer = Tokenizer(cluster.folder)

        def job(i: int) -> tuple[str, int]:
            """(prompt, max_tokens): every sixth a long generation, the rest short."""
            if i % 6 == 0:
                return f"request {i}: {PROMPT}", 860
            return f"request {i}: {PROMPT * (1 + i % 3)}", 24

        signallers = {
            "decode": Signaller(cluster, "decode"),
            "prefill": Signaller(cluster, "prefill"),
        }
        jobs: list[tuple[str, int]] = []
        with ThreadPoolExecutor(max_workers=MAX_JOBS) as pool:
            futures = []
            # Ten requests a second, until both workers have been signalled and some requests
            # have come after the second signal.
            while len(jobs) < MIN_JOBS or any(
                s.is_alive() or not s.at for s in signallers.values()
            ):
                assert len(jobs) < MAX_JOBS, "no worker was signalled"
                jobs.append(job(len(jobs)))
                futures.append(pool.submit(complete, cluster.base, jobs[-1]))
                time.sleep(0.1)
                if len(jobs) == 8:  # two long generations are running
                    signallers["decode"].start()
                if len(jobs) == 12:
                    signallers["prefill"].start()
            exits = {}
            for role, signaller in signallers.items():
                assert signaller.worker_id, f"no {role} worker got busy"
                code = cluster.processes[signaller.worker_id].wait(timeout=DRAIN_TIMEOUT_S + 60)
                exits[role] = (code, time.monotonic() - signaller.at)
            results = [future.result(timeout=300) for future in futures]

        for role, signaller in signallers.items():
            code, took = exits[role]
            assert code == 0, cluster.log(signaller.worker_id)
            left = left_at(cluster, signaller.worker_id) - signaller.wall_clock_at
            assert left < DRAIN_TIMEOUT_S + LEAVE_SLACK_S, (role, left)
            assert took < DRAIN_TIMEOUT_S + EXIT_SLACK_S, (role, took)
        pools = cluster.workers()
        assert [len(pools["prefill"]), len(pools["decode"])] == [1, 1]

        expected = greedy_answers(cluster.folder, tokenizer, jobs)
        assert [r["finish_reason"] for r in results] == ["length"] * len(jobs)
        for i, (result, tokens) in enumerate(zip(results, expected, strict=True)):
            assert result["text"] == tokenizer.decode(tokens), i
        report = {role: drain_report(cluster, s.worker_id) for role, s in signallers.items()}
        print(f"{len(jobs)} requests; (exit code, seconds from SIGTERM to exit):", exits,
              "(requests held at SIGTERM, moved by the router when it left):", report)  # fmt: skip
