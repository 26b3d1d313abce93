"""Plays the router for worker tests: real worker processes, real sockets, on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from common.messages import Message, ProtocolError, decode, encode
from common.metrics import parse_exposition
from common.protocol import (
    CacheEvents,
    DecodeRequest,
    Handoff,
    HandoffPart,
    Heartbeat,
    LeaveAck,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    TokenDelta,
    TokenDeltas,
    WorkerDraining,
)
from common.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent


@dataclass
class RequestLog:
    deltas: list[TokenDelta] = field(default_factory=list)
    failures: list[RequestFailed] = field(default_factory=list)
    column_tokens: int = 0  # tokens that came in a TokenDeltas frame's columns

    @property
    def token_ids(self) -> list[int]:
        ordered = sorted(self.deltas, key=lambda d: d.start_index)
        return [s.token_id for d in ordered for s in d.samples]

    @property
    def finished(self) -> bool:
        return any(d.finish_reason is not None for d in self.deltas)


class FakeRouter:
    def __init__(self, tmp_path: Path) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.tmp_path = tmp_path
        self.workers: dict[str, RegisterWorker] = {}
        self.heartbeats: dict[str, Heartbeat] = {}
        self.cache_events: dict[str, list[CacheEvents]] = {}
        self.requests: dict[str, RequestLog] = {}
        self.processes: list[subprocess.Popen] = []

    # -- processes ------------------------------------------------------------------------------

    def start_worker(self, role: str, model: Path, *extra: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"{role}-{len(self.processes)}.log", "w")  # noqa: SIM115
        args = [
            sys.executable, "-m", f"{role}_worker", "--router", self.address,
            "--model", str(model), "--dtype", "float32", "--device", "cpu",
            "--log-level", "INFO", *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def wait_registered(self, count: int, timeout: float = 120.0) -> list[RegisterWorker]:
        deadline = time.monotonic() + timeout
        while len(self.workers) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.workers)} of {count} workers registered")
            for process in self.processes:
                if process.poll() is not None and process.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"a worker exited with {process.returncode}")
            self.pump(0.2)
        return list(self.workers.values())

    def worker(self, role: str) -> RegisterWorker:
        return next(w for w in self.workers.values() if w.role == role)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        # The workers drain: answer their leaving (LeaveAck) as a router does, so they need
        # not wait out the ack's timeout.
        deadline = time.monotonic() + 20
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            self.pump(0.05)
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        self.context.destroy(linger=0)  # closes every socket a test opened on it, too

    # -- traffic --------------------------------------------------------------------------------

    def send(self, worker_id: str, msg: Message) -> None:
        self.socket.send_multipart([worker_id.encode(), encode(msg)])

    def send_raw(self, worker_id: str, *frames: bytes) -> None:
        self.socket.send_multipart([worker_id.encode(), *frames])

    def pump(self, timeout: float) -> None:
        """Handle whatever arrives within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if not self.socket.poll(max(0, int(remaining * 1000))):
                return
            identity, frame = self.socket.recv_multipart()
            try:
                msg = decode(frame)
            except ProtocolError as exc:
                raise AssertionError(f"worker sent a bad frame: {exc}") from exc
            self._handle(identity.decode(), msg)

    def _handle(self, worker_id: str, msg: Message) -> None:
        if isinstance(msg, RegisterWorker):
            self.workers[worker_id] = msg
            self.send(worker_id, RegisterAck(accepted=True, heartbeat_interval=0.2))
        elif isinstance(msg, Heartbeat):
            self.heartbeats[worker_id] = msg
        elif isinstance(msg, CacheEvents):
            self.cache_events.setdefault(worker_id, []).append(msg)
        elif isinstance(msg, TokenDelta):
            self.requests.setdefault(msg.request_id, RequestLog()).deltas.append(msg)
        elif isinstance(msg, TokenDeltas):
            for delta in msg.all_deltas():
                self.requests.setdefault(delta.request_id, RequestLog()).deltas.append(delta)
            for request_id in msg.token_request_ids:
                self.requests[request_id].column_tokens += 1
        elif isinstance(msg, RequestFailed):
            self.requests.setdefault(msg.request_id, RequestLog()).failures.append(msg)
        elif isinstance(msg, WorkerDraining) and msg.leaving:
            self.send(worker_id, LeaveAck(worker_id))

    def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        handoff_endpoint: str | None = None,
    ) -> None:
        prefill, decode_worker = self.worker("prefill"), self.worker("decode")
        self.send(
            prefill.worker_id,
            PrefillRequest(
                request_id,
                prompt,
                params,
                decode_worker.worker_id,
                handoff_endpoint or decode_worker.handoff_endpoint,
            ),
        )

    def decode_locally(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.send(
            self.worker("decode").worker_id,
            DecodeRequest(request_id, prompt, params),
        )

    def wait_finished(self, request_ids: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.log(r).finished or self.log(r).failures for r in request_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests not finished: {request_ids}")
            self.pump(0.1)

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            self.pump(0.1)

    def log(self, request_id: str) -> RequestLog:
        return self.requests.setdefault(request_id, RequestLog())

    def metrics(self, role: str) -> dict[str, float]:
        text = urllib.request.urlopen(self.worker(role).metrics_url, timeout=10).read().decode()
        return parse_exposition(text)


class HandoffTap:
    """A PULL socket that stands in for a decode worker's handoff endpoint, to hold handoffs."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[Message] = []  # everything, in order: HandoffParts, then Handoffs

    def next(self, timeout: float) -> Message:
        """The next message a prefill worker sent (kept in ``received`` too)."""
        if not self.socket.poll(max(0, int(timeout * 1000))):
            raise TimeoutError("nothing arrived on the handoff tap")
        msg = decode(self.socket.recv(), max_size=64 << 20)
        self.received.append(msg)
        return msg

    def receive(self, timeout: float) -> Handoff:
        """The next Handoff; the HandoffParts before it are kept in ``received``."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next(deadline - time.monotonic())
            assert isinstance(msg, Handoff | HandoffPart), type(msg).__name__
            if isinstance(msg, Handoff):
                return msg

    def forward(self, push: zmq.Socket) -> None:
        """Send on everything received so far, in order (to the decode worker it was for)."""
        for msg in self.received:
            push.send(encode(msg))

    def close(self) -> None:
        self.socket.close(linger=0)
