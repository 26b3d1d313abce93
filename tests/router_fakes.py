"""Test doubles for the router: a uvicorn server in a thread and fake workers that speak the real
protocol over real ZeroMQ sockets.

``FakeWorker`` answers at once with made-up tokens (one delta per tick, so a stream is in flight
long enough to be interrupted), or with a script's (``answer``: say, a text encoded with the
model's tokenizer), keeps a real ``PageManager`` so its cache events are the ones a worker would
publish, and hands prompts to a decode ``FakeWorker`` in-process. ``EnginePair`` wraps one real
``LLMEngine`` behind a prefill and a decode identity.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import httpx
import uvicorn
import zmq

from common.engine.page_manager import PageManager
from common.hashing import page_hashes
from common.kv_layout import KVLayout
from common.messages import PROTOCOL_VERSION, Message, decode, encode
from common.protocol import (
    ROLE_DECODE,
    ROLE_PREFILL,
    AbortRequest,
    CacheEvents,
    DecodeRequest,
    Heartbeat,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    TokenDelta,
    TokenDeltas,
    TokenSample,
)
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from router.app import create_app
from router.config import RouterConfig
from router.http_protocol import with_read_deadline

HEARTBEAT = 0.1
# What a fake answers a request with, given its prompt and params: the token ids to generate
# (then it stops, as on an end-of-sequence token), or None for the usual ``1000 + position``.
Script = Callable[[list[int], SamplingParams], list[int] | None]
# How long a wait for something that happens in a moment may take on a loaded 2-core machine,
# where the router and the fake workers share one process (and its GIL) with the test.
DEADLINE_S = 30.0


class ControlSocket:
    """One DEALER identity on the router's control socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def recv(self) -> Message | None:
        try:
            return decode(self.sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None


def register_worker(
    sock: ControlSocket,
    worker_id: str,
    role: str,
    model: str,
    page_size: int,
    incarnation: str = "",
) -> RegisterAck:
    """Register ``worker_id`` and wait for the ack; each call a new incarnation (a restarted
    process) unless one is given."""
    sock.send(
        RegisterWorker(
            protocol_version=PROTOCOL_VERSION,
            worker_id=worker_id,
            incarnation=incarnation or secrets.token_hex(8),
            role=role,
            model=model,
            kv_layout=KVLayout("bfloat16", page_size, 2, 2, 64),
            kv_transfer="zmq",
            num_pages=4096,
            max_model_len=8192,
            metrics_url=f"http://127.0.0.1:0/{worker_id}/metrics",
            handoff_endpoint=f"inproc://{worker_id}" if role == ROLE_DECODE else None,
        )
    )
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if sock.sock.poll(100):
            msg = decode(sock.sock.recv())
            assert isinstance(msg, RegisterAck), msg
            return msg
    raise TimeoutError(f"{worker_id}: no RegisterAck")


@dataclass
class _Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    next_index: int
    out: ControlSocket | None = None
    script: list[int] | None = None  # the tokens to answer with, if scripted


def _finish(generated: int, params: SamplingParams, script: list[int] | None) -> str | None:
    """Why a sequence that has ``generated`` tokens ends there, if it does: its script done (as
    a model's end-of-sequence token ends it), or its length reached."""
    if script is not None and generated >= len(script):
        return "stop"
    return "length" if generated >= params.max_tokens else None


def wait_until(condition, timeout: float = DEADLINE_S) -> None:
    """Poll ``condition`` until it holds; fail after a deadline generous for a loaded machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout} s: {condition}"
        time.sleep(0.01)


class FakeWorker(threading.Thread):
    """A worker that answers with token ``1000 + position``, or as ``answer`` scripts a
    request; ``hub`` maps ids to workers."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        role: str,
        model: str,
        hub: dict[str, FakeWorker],
        page_size: int = 16,
        tokens_per_tick: int = 1,
        tick: float = 0.005,
        answer: Script | None = None,
    ):
        super().__init__(daemon=True, name=f"fake-{worker_id}")
        self.answer = answer
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.role = role
        self.model = model
        self.hub = hub
        self.page_size = page_size
        self.tokens_per_tick = tokens_per_tick
        self.tick = tick
        self.pages = PageManager(4096, page_size)
        self.received: list[Message] = []
        self.inbox: queue.Queue[_Job] = queue.Queue()  # handoffs from prefill fakes
        self.jobs: dict[str, _Job] = {}
        self.stop_event = threading.Event()
        self.silent = threading.Event()  # set: stop heartbeats and answers (a hung worker)
        # Set: prefill requests queue up unanswered (a busy worker; heartbeats report them as
        # queued prefill tokens); cleared: the queue is answered.
        self.hold_prefills = threading.Event()
        self.held: list[PrefillRequest] = []
        self.handoffs_to_lose = 0  # a prefill fake loses this many handoffs (sends no job on)
        # Set: the worker is stuck. Its heartbeats go on and list what it holds, but it takes no
        # step and moves nothing (a wedged step loop whose heartbeat thread still runs).
        self.wedged = threading.Event()
        self.num_steps = 0  # ticks with work, as a worker counts its steps
        # What its heartbeats say of its pace: prompt tokens per second of step, and requests
        # finished per second (0: not measured).
        self.prefill_tokens_per_s = 0.0
        self.finished_per_s = 0.0
        self.ack: RegisterAck | None = None
        self.ready = threading.Event()
        hub[worker_id] = self

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ControlSocket(ctx, self.endpoint, self.worker_id)
        try:
            self.ack = register_worker(sock, self.worker_id, self.role, self.model, self.page_size)
            sock.send(CacheEvents(self.worker_id, [], [], reset=True))
            self.ready.set()
            last_beat = 0.0
            while not self.stop_event.is_set():
                if self.silent.is_set():
                    time.sleep(0.01)
                    continue
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT:
                    last_beat = now
                    sock.send(self._heartbeat())
                # Handoffs first: an abort may follow its handoff closely.
                while not self.inbox.empty():
                    job = self.inbox.get()
                    job.out = sock
                    self.jobs[job.request_id] = job
                while (msg := sock.recv()) is not None:
                    self.received.append(msg)
                    stalled = self.hold_prefills.is_set() or self.wedged.is_set()
                    if isinstance(msg, PrefillRequest) and stalled:
                        self.held.append(msg)
                    else:
                        self._handle(sock, msg)
                if self.wedged.is_set():
                    sock.sock.poll(int(self.tick * 1000) or 1)
                    continue
                if self.held or self.jobs:
                    self.num_steps += 1
                while self.held and not self.hold_prefills.is_set():
                    self._handle(sock, self.held.pop(0))
                self._generate()
                sock.sock.poll(int(self.tick * 1000) or 1)
        finally:
            sock.sock.close(0)
            ctx.term()

    def _heartbeat(self) -> Heartbeat:
        queued = sum(len(m.prompt_token_ids) for m in self.held)
        held = {m.request_id: 0 for m in self.held}  # queued: they have not moved yet
        held.update({job.request_id: job.next_index for job in self.jobs.values()})
        return Heartbeat(
            self.worker_id,
            len(self.jobs),
            len(self.held),
            queued,
            self.pages.num_free_pages,
            0.0,
            num_steps=self.num_steps,
            held_request_ids=list(held),
            held_progress=list(held.values()),
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            finished_per_s=self.finished_per_s,
        )

    def _handle(self, sock: ControlSocket, msg: Message) -> None:
        if isinstance(msg, AbortRequest):
            self.jobs.pop(msg.request_id, None)
        elif isinstance(msg, PrefillRequest):
            params = msg.params
            script = self._script(msg.prompt_token_ids, params)
            cached = self._prefill(msg.prompt_token_ids)
            sock.send(CacheEvents(self.worker_id, *self._drain()))
            finish = _finish(1, params, script)
            sock.send(
                TokenDelta(
                    msg.request_id,
                    [self._next(0, params, script)],
                    0,
                    finish,
                    len(msg.prompt_token_ids),
                    cached,
                    first=True,
                )
            )
            if finish is None and self.handoffs_to_lose > 0:
                self.handoffs_to_lose -= 1
            elif finish is None:
                self.hub[msg.decode_worker_id].inbox.put(
                    _Job(msg.request_id, msg.prompt_token_ids, params, 1, script=script)
                )
        elif isinstance(msg, DecodeRequest):
            params = msg.params
            job = _Job(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                len(msg.output_token_ids),
                sock,
                self._script(msg.prompt_token_ids, params),
            )
            self.jobs[msg.request_id] = job

    def _script(self, prompt: list[int], params: SamplingParams) -> list[int] | None:
        script = None if self.answer is None else self.answer(prompt, params)
        assert script is None or script, "a scripted answer needs at least one token"
        return script

    def _prefill(self, prompt: list[int]) -> int:
        """File the prompt's full pages like a worker's prefix cache; returns cached tokens."""
        hit = self.pages.match_prefix(prompt)
        self.pages.acquire(hit)
        full = len(prompt) // self.page_size
        new = self.pages.allocate(full - len(hit)) if full > len(hit) else []
        hashes = page_hashes(prompt, self.page_size)
        for i in range(len(hit), full):
            chunk = prompt[i * self.page_size : (i + 1) * self.page_size]
            self.pages.cache_page(new[i - len(hit)], hashes[i], chunk)
        self.pages.free(hit + new)
        return len(hit) * self.page_size

    def _drain(self) -> tuple[list[int], list[int]]:
        events = self.pages.drain_events()
        return list(events.stored), list(events.removed)

    def _sample(self, index: int, params: SamplingParams) -> TokenSample:
        top = None
        if params.logprobs is not None:
            top = [1000 + index + k for k in range(params.logprobs)]
        return TokenSample(
            1000 + index, -0.5 if top is not None else None, top, [-0.5] * len(top or [])
        )

    def _next(self, index: int, params: SamplingParams, script: list[int] | None) -> TokenSample:
        """The sample at ``index``: the script's token where there is one."""
        sample = self._sample(index, params)
        return sample if script is None else replace(sample, token_id=script[index])

    def _generate(self) -> None:
        """One tick of decoding: every job's deltas in one frame per socket, as a real decode
        worker sends a step's deltas (``TokenDeltas``; a lone delta goes as itself)."""
        by_socket: dict[int, tuple[ControlSocket, list[TokenDelta]]] = {}
        for job in list(self.jobs.values()):
            count = min(self.tokens_per_tick, job.params.max_tokens - job.next_index)
            if job.script is not None:
                count = min(count, len(job.script) - job.next_index)
            samples = [self._next(job.next_index + k, job.params, job.script) for k in range(count)]
            finish = _finish(job.next_index + count, job.params, job.script)
            done = finish is not None
            # A stop token ends the sequence there, as a real worker's scheduler does.
            stops = [i for i, s in enumerate(samples) if s.token_id in job.params.stop_token_ids]
            if stops:
                samples, count, done, finish = samples[: stops[0] + 1], stops[0] + 1, True, "stop"
            assert job.out is not None
            delta = TokenDelta(
                job.request_id,
                samples,
                job.next_index,
                finish,
                len(job.prompt),
                0,
                first=job.next_index == 0,
            )
            by_socket.setdefault(id(job.out), (job.out, []))[1].append(delta)
            job.next_index += count
            if done:
                del self.jobs[job.request_id]
        for sock, deltas in by_socket.values():
            sock.send(deltas[0] if len(deltas) == 1 else TokenDeltas(deltas))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


class EnginePair(threading.Thread):
    """One real ``LLMEngine`` serving as prefill worker ``p`` and decode worker ``d``."""

    def __init__(self, endpoint: str, engine, model: str, prefill_id: str, decode_id: str):
        super().__init__(daemon=True, name="engine-pair")
        self.endpoint = endpoint
        self.engine = engine
        self.model = model
        self.prefill_id = prefill_id
        self.decode_id = decode_id
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.received: list[Message] = []
        # request id -> (position of its next token, socket its next tokens go out on)
        self._routes: dict[str, list] = {}

    def run(self) -> None:
        ctx = zmq.Context()
        page_size = self.engine.config.cache.page_size
        p = ControlSocket(ctx, self.endpoint, self.prefill_id)
        d = ControlSocket(ctx, self.endpoint, self.decode_id)
        try:
            register_worker(p, self.prefill_id, ROLE_PREFILL, self.model, page_size)
            register_worker(d, self.decode_id, ROLE_DECODE, self.model, page_size)
            p.send(CacheEvents(self.prefill_id, [], [], reset=True))
            self.ready.set()
            last_beat = 0.0
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT:
                    last_beat = now
                    free = self.engine.page_manager.num_free_pages
                    p.send(Heartbeat(self.prefill_id, 0, 0, 0, free, 0.0))
                    d.send(Heartbeat(self.decode_id, 0, 0, 0, free, 0.0))
                for sock in (p, d):
                    while (msg := sock.recv()) is not None:
                        self.received.append(msg)
                        self._handle(sock, p, d, msg)
                if self.engine.has_unfinished:
                    self._step(p, d)
                else:
                    p.sock.poll(5)
        finally:
            for sock in (p, d):
                sock.sock.close(0)
            ctx.term()

    def _handle(
        self, sock: ControlSocket, p: ControlSocket, d: ControlSocket, msg: Message
    ) -> None:
        if isinstance(msg, AbortRequest):
            self.engine.abort(msg.request_id)
            self._routes.pop(msg.request_id, None)
        elif isinstance(msg, PrefillRequest):
            params = msg.params
            self.engine.add_request(msg.prompt_token_ids, params, msg.request_id)
            self._routes[msg.request_id] = [0, p]
        elif isinstance(msg, DecodeRequest):
            params = msg.params
            done = len(msg.output_token_ids)
            params.max_tokens -= done
            prompt = msg.prompt_token_ids + msg.output_token_ids
            self.engine.add_request(prompt, params, msg.request_id)
            self._routes[msg.request_id] = [done, d]

    def _step(self, p: ControlSocket, d: ControlSocket) -> None:
        outputs = self.engine.step()
        events = self.engine.page_manager.drain_events()
        if events:
            p.send(CacheEvents(self.prefill_id, list(events.stored), list(events.removed)))
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            index, sock = route
            samples = [
                TokenSample(
                    s.token_id,
                    s.logprob,
                    None if s.top_logprobs is None else [t for t, _ in s.top_logprobs],
                    None if s.top_logprobs is None else [lp for _, lp in s.top_logprobs],
                )
                for s in out.new_samples
            ]
            reason = None
            if out.finished:
                reason = getattr(out.finish_reason, "value", out.finish_reason)
            sock.send(
                TokenDelta(
                    out.request_id,
                    samples,
                    index,
                    reason,
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                    first=index == 0 and sock is p,
                )
            )
            route[0] += len(samples)
            route[1] = d  # after the first token, the "decode worker" speaks
            if out.finished:
                del self._routes[out.request_id]

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


@dataclass
class RouterServer:
    base_url: str
    control: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread
    workers: list = field(default_factory=list)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=DEADLINE_S, **kwargs)

    def wait_for_workers(self, prefill: int, decode: int, timeout: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + timeout
        headers = {}
        key = self.app.state.config.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        with self.client() as c:
            while time.monotonic() < deadline:
                pools = c.get("/v1/workers", headers=headers).json()
                if len(pools["prefill"]) == prefill and len(pools["decode"]) == decode:
                    return
                time.sleep(0.02)
        raise TimeoutError(f"expected {prefill} prefill and {decode} decode workers: {pools}")

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


_TEXT: dict[str, Tokenizer] = {}


def model_text(path) -> Tokenizer:
    key = str(path)
    if key not in _TEXT:
        _TEXT[key] = Tokenizer(path)
    return _TEXT[key]


@contextlib.contextmanager
def router_server(model_path, read_timeout: float = 30.0, **overrides) -> Iterator[RouterServer]:
    text = model_text(model_path)
    config = RouterConfig(
        served_model_name=overrides.pop("served_model_name", model_path.name),
        max_model_len=overrides.pop("max_model_len", 2048),
        control="tcp://127.0.0.1:0",
        # Generous: fake workers share a process (and its GIL) with the router under test.
        heartbeat_timeout=overrides.pop("heartbeat_timeout", 10.0),
        **overrides,
    )
    app = create_app(config, text)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            http=with_read_deadline(read_timeout),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True, name="router")
    thread.start()
    deadline = time.monotonic() + 2 * DEADLINE_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the router did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    handle = RouterServer(
        f"http://127.0.0.1:{port}", app.state.control.endpoint, app, server, thread
    )
    try:
        yield handle
    finally:
        for worker in handle.workers:
            worker.stop()
        server.should_exit = True
        thread.join(timeout=10)


def start_fakes(router: RouterServer, hub: dict, specs: list[tuple[str, str]], **kw) -> list:
    """Start FakeWorkers given as (worker_id, role) and wait until they are registered."""
    config = router.app.state.config
    model = config.worker_model or config.served_model_name
    workers = [FakeWorker(router.control, wid, role, model, hub, **kw) for wid, role in specs]
    for w in workers:
        w.start()
        router.workers.append(w)
    for w in workers:
        assert w.ready.wait(DEADLINE_S), f"{w.worker_id} did not register"
    return workers


@contextlib.contextmanager
def router_with_a_pair(model_path, **overrides) -> Iterator[RouterServer]:
    """A router with a prefill FakeWorker "p0" and a decode FakeWorker "d0" registered."""
    with router_server(model_path, **overrides) as router:
        start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        yield router
