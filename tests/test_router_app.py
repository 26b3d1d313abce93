"""The router over HTTP with the official openai client, against fake workers on real sockets."""

from __future__ import annotations

import contextlib
import importlib.metadata
import random
import socket
import threading
import time

import httpx
import openai
import pytest
import tomllib
import zmq
from router_fakes import (
    DEADLINE_S,
    ControlSocket,
    FakeWorker,
    model_text,
    register_worker,
    router_server,
    start_fakes,
    wait_until,
)
from zmq_strangers import send_unless_refused

from common.model.default_model import resolve_model_path
from common.protocol import ROLE_PREFILL, AbortRequest, DecodeRequest, PrefillRequest
from common.version import PYPROJECT, pdserve_version
from router.server import build_parser, config_from_args

MODEL = resolve_model_path(None)


def client(router, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0, **kw)


@pytest.fixture()
def cluster():
    with router_server(MODEL) as router:
        hub: dict = {}
        start_fakes(router, hub, [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")])
        router.wait_for_workers(2, 1)
        router.hub = hub
        yield router


def long_prompt(seed: int, words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(words))


def prefill_requests(worker: FakeWorker) -> list[PrefillRequest]:
    return [m for m in worker.received if isinstance(m, PrefillRequest)]


def test_completions_n_logprobs_usage_and_request_id(cluster):
    c = client(cluster)
    raw = c.completions.with_raw_response.create(
        model=MODEL.name,
        prompt=long_prompt(0),
        max_tokens=4,
        n=2,
        logprobs=2,
        seed=5,
        extra_headers={"X-Request-Id": "abc/../123"},
    )
    assert raw.headers["x-request-id"] == "abc..123"
    out = raw.parse()
    assert out.id.startswith("cmpl-abc..123")
    assert [ch.index for ch in out.choices] == [0, 1]
    assert all(ch.finish_reason == "length" for ch in out.choices)
    assert all(
        len(ch.logprobs.tokens) == 4 and len(ch.logprobs.top_logprobs[0]) == 2 for ch in out.choices
    )
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens_details.cached_tokens > 0  # choice 2 reuses choice 1's prefix
    # Both choices went to the same prefill worker, with seed + i.
    sent = prefill_requests(cluster.hub["p0"]) + prefill_requests(cluster.hub["p1"])
    assert len({m.request_id.rsplit("-", 1)[0] for m in sent}) == 1
    assert sorted(m.params.seed for m in sent) == [5, 6]
    holders = [w for w in ("p0", "p1") if prefill_requests(cluster.hub[w])]
    assert len(holders) == 1


def test_chat_stream_with_usage_and_stop_string(cluster):
    c = client(cluster)
    stream = c.chat.completions.create(
        model=MODEL.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=1,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # The fake answers token 1000 + i; cut at the text of the third token.
    full = c.completions.create(model=MODEL.name, prompt=[1, 2, 3], max_tokens=8)
    assert full.choices[0].text == text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = c.completions.create(model=MODEL.name, prompt=[1, 2, 3], max_tokens=8, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_multiple_prompts_and_echo(cluster):
    out = client(cluster).completions.create(
        model=MODEL.name, prompt=["one", "two"], max_tokens=2, echo=True
    )
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("one") and out.choices[1].text.startswith("two")


def test_models_tokenize_detokenize_health_metrics_workers(cluster):
    with cluster.client() as h:
        assert h.get("/v1/models").json()["data"][0]["id"] == MODEL.name
        tokens = h.post("/tokenize", json={"prompt": "héllo 👋"}).json()["tokens"]
        assert h.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "héllo 👋"
        assert h.get("/health").status_code == 200
        assert h.get("/version").json() == {
            "version": importlib.metadata.version("pdserve"),
            "server": "pdserve",
        }
        workers = h.get("/v1/workers").json()
        assert {w["id"] for w in workers["prefill"]} == {"p0", "p1"}
        assert workers["decode"][0]["endpoint"] == "inproc://d0"
        assert workers["decode"][0]["metrics_url"].endswith("/metrics")
        client(cluster).completions.create(model=MODEL.name, prompt="x", max_tokens=1)
        assert "pdserve_router_decisions_total" in h.get("/metrics").text


def test_served_model_names_aliases_and_the_model_path():
    """`--served-model-name a b`: both are listed and answered to, responses report the first;
    the model's path is accepted as a name too (`vllm bench serve --model PATH` sends it)."""
    args = build_parser().parse_args(["--model", str(MODEL), "--served-model-name", "a", "b"])
    config = config_from_args(args, model_text(MODEL), MODEL)
    assert (config.served_model_name, config.model_aliases) == ("a", ("b",))
    assert str(MODEL) in config.model_path_names and config.worker_model == MODEL.name
    overrides = {
        "served_model_name": "a",
        "model_aliases": ("b",),
        "model_path_names": config.model_path_names,
        "worker_model": MODEL.name,
    }
    with router_server(MODEL, **overrides) as router:
        start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        c = client(router)
        assert [m.id for m in c.models.list().data] == ["a", "b"]
        for name in ("a", "b", str(MODEL)):
            assert c.completions.create(model=name, prompt="x", max_tokens=1).model == "a"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=MODEL.name + "-other", prompt="x", max_tokens=1)


def test_errors_are_openai_shaped(cluster):
    c = client(cluster)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        c.completions.create(model=MODEL.name, prompt=[5] * 3000)
    with pytest.raises(openai.BadRequestError, match="2048"):
        c.completions.create(model=MODEL.name, prompt=[5] * 2000, max_tokens=100)
    with cluster.client() as h:
        r = h.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        r = h.post("/v1/completions", json={"model": MODEL.name, "prompt": "x" * (5 << 20)})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert h.get("/v1/nothing").json()["error"]["code"] == "not_found"
        r = h.post("/tokenize", json={"messages": []})  # no conversation to template
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.slow
def test_out_of_range_parameters_are_refused_and_leave_nothing_in_flight():
    """Numbers the wire cannot carry, or that make no sense, are a 400 naming the parameter at
    the edge; 4,096 of them leave the in-flight table as it was, so the next request is served
    (the router here admits 16 sequences in flight at most)."""
    huge = 1 << 64
    bad = [
        ({"top_k": huge}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": huge << 8}, "seed"),
        ({"min_tokens": huge, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [huge]}, "stop_token_ids"),
        ({"logprobs": huge}, "logprobs"),
        ({"n": huge}, "n"),
        ({"max_tokens": huge}, "max_tokens"),
        ({"top_p": 2.0}, "top_p"),
        ({"stop": ["x" * 5000]}, "stop"),
    ]
    with router_server(MODEL, max_inflight=16) as router:
        hub: dict = {}
        start_fakes(router, hub, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        with router.client() as h:
            for i in range(4096):
                fields, param = bad[i % len(bad)]
                r = h.post("/v1/completions", json={"model": MODEL.name, "prompt": "hi", **fields})
                assert r.status_code == 400, (fields, r.status_code, r.text)
                assert r.json()["error"]["param"] == param, (fields, r.json())
            r = h.post("/v1/completions", json={"model": MODEL.name, "prompt": "hi", "top_k": 5})
            assert r.status_code == 200, r.text
            # A failure the router did not foresee, while dispatching: a 500, and nothing kept.
            dispatcher = router.app.state.dispatcher
            send = dispatcher.send

            def broken(worker_id, msg):
                if isinstance(msg, PrefillRequest | DecodeRequest):
                    raise RuntimeError("a bug on the dispatch path")
                send(worker_id, msg)

            dispatcher.send = broken
            for _ in range(32):
                r = h.post("/v1/completions", json={"model": MODEL.name, "prompt": "hi"})
                assert r.status_code == 500 and "error" in r.json()
            dispatcher.send = send
            assert not dispatcher.generations
            r = h.post("/v1/completions", json={"model": MODEL.name, "prompt": "hi"})
            assert r.status_code == 200, r.text
        assert router.metric("pdserve_router_inflight_requests") == 0


@pytest.mark.slow
def test_health_answers_while_a_megabyte_prompt_is_tokenized(cluster, monkeypatch):
    """Tokenizing a 3 MB prompt takes seconds; it happens off the event loop, so /health and
    every stream are served meanwhile. The encode is held open until /health has answered: on
    the event loop that would be a deadlock, which the /health timeout turns into a failure."""
    prompt = "hello world, this is a long prompt. " * 80_000
    codec = model_text(MODEL)
    encode = codec.encode
    entered, release = threading.Event(), threading.Event()

    def held_open(text, *args, **kwargs):
        if len(text) > 1_000_000:
            entered.set()
            release.wait(timeout=60)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(codec, "encode", held_open)
    outcome: list[httpx.Response] = []

    def send_big() -> None:
        with cluster.client() as h:
            outcome.append(h.post("/v1/completions", json={"model": MODEL.name, "prompt": prompt}))

    big = threading.Thread(target=send_big)
    big.start()
    try:
        assert entered.wait(timeout=60)
        with httpx.Client(base_url=cluster.base_url, timeout=10) as h:
            assert h.get("/health").status_code == 200
    finally:
        release.set()
        big.join(timeout=120)
    assert outcome[0].status_code == 400 and "maximum context length" in outcome[0].text


REFUSED = [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    # Tools default to tool_choice "auto", which needs --enable-auto-tool-choice (as in vLLM).
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
    ),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 100}}, "logit_bias"),  # out of vocab
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": " the end"}, "suffix"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"guided_json": {"type": "object", "required": 7}}, "guided_json"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),  # beam search only
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
]
# Values of the same fields that change nothing, and fields that never change the answer.
ACCEPTED = [
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "logit_bias": {},
                              "tool_choice": "none", "parallel_tool_calls": False}),
    ("/v1/chat/completions", {"add_generation_prompt": True, "echo": False, "metadata": {"a": 1},
                              "store": False, "service_tier": "auto", "modalities": ["text"]}),
    ("/v1/completions", {"best_of": 1, "suffix": None, "logit_bias": None, "priority": 0,
                         "prompt_logprobs": None, "user": "u"}),
]  # fmt: skip


def test_fields_that_would_change_the_answer_are_refused_not_dropped(cluster):
    """A field pdserve does not implement is a 400 naming it, unless its value changes nothing:
    a client asking for JSON output must not get free text without a word."""
    base = {"model": MODEL.name, "max_tokens": 2}
    with cluster.client() as h:
        for path, fields, param in REFUSED:
            body = base | ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                           else {"prompt": "hi"}) | fields  # fmt: skip
            r = h.post(path, json=body)
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param
        for path, fields in ACCEPTED:
            body = base | ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                           else {"prompt": "hi"}) | fields  # fmt: skip
            r = h.post(path, json=body)
            assert r.status_code == 200, (fields, r.text)


def test_api_key():
    with router_server(MODEL, api_key="sekret") as router:
        start_fakes(router, {}, [("d0", "decode")])
        with pytest.raises(openai.AuthenticationError):
            client(router).models.list()
        ok = openai.OpenAI(base_url=router.base_url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL.name, prompt="x", max_tokens=1).choices
        with router.client() as h:
            assert h.get("/v1/models").status_code == 401
            assert h.get("/health").status_code == 200  # probes need no key


def test_slow_clients_are_cut_off_and_others_still_served():
    """Connections that send their request a trickle at a time (slowloris) are closed once the
    read deadline passes, while requests that arrive whole are answered meanwhile; headers
    past 64 KiB are a 400."""
    with router_server(MODEL, read_timeout=1.0) as router:
        start_fakes(router, {}, [("d0", "decode")])
        host, port = router.base_url.removeprefix("http://").split(":")
        slow = []
        for i in range(50):
            sock = socket.create_connection((host, int(port)), timeout=30)
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else "GET /hea"
            sock.sendall(head.encode())
            slow.append(sock)
        with router.client() as h:
            assert h.get("/health").status_code == 200
            body = {"model": MODEL.name, "prompt": "x", "max_tokens": 2}
            assert h.post("/v1/completions", json=body).status_code == 200
        for sock in slow:  # each is closed by the server: recv sees the end (deadline: 30 s)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""
            sock.close()
        huge = socket.create_connection((host, int(port)), timeout=30)
        huge.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n"
        )
        assert huge.recv(1024).startswith(b"HTTP/1.1 400")
        huge.close()


def test_control_socket_admits_only_holders_of_the_cluster_secret():
    secret = "a cluster secret of some length"
    with router_server(MODEL, cluster_secret=secret) as router:
        context = zmq.Context()
        try:
            stranger = context.socket(zmq.DEALER)  # a worker without the secret
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(router.control)
            send_unless_refused(stranger, b"a registration would go here")
            deadline = time.monotonic() + DEADLINE_S
            while router.metric("pdserve_auth_failures_total", socket="control") < 1:
                assert time.monotonic() < deadline, "the stranger's handshake was not refused"
                time.sleep(0.05)
        finally:
            context.destroy(linger=0)
        assert router.metric("pdserve_router_protocol_errors_total") == 0  # nothing got in
        with router.client() as h:
            assert h.get("/v1/workers").json()["decode"] == []


def test_no_decode_worker_is_503_and_no_prefill_means_local_prefill():
    with router_server(MODEL) as router:
        with pytest.raises(openai.InternalServerError) as info:
            client(router).completions.create(model=MODEL.name, prompt="x")
        assert info.value.status_code == 503
        hub: dict = {}
        (d0,) = start_fakes(router, hub, [("d0", "decode")])
        out = client(router).completions.create(
            model=MODEL.name, prompt=long_prompt(1), max_tokens=3
        )
        assert out.choices[0].finish_reason == "length"
        assert any(isinstance(m, DecodeRequest) for m in d0.received)
        assert (
            router.metric(
                "pdserve_router_decisions_total", reason="local_prefill_no_prefill_workers"
            )
            == 1
        )


def test_refused_registration():
    with router_server(MODEL) as router:
        w = FakeWorker(router.control, "x", "prefill", "other-model", {})
        w.start()
        router.workers.append(w)
        assert w.ready.wait(DEADLINE_S)
        assert w.ack is not None and not w.ack.accepted and "model" in w.ack.reason


def test_garbage_on_the_control_socket_is_dropped_and_counted(cluster):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.control)
    for frame in [b"\x00garbage", b"\x81\xa4type\xa3bad", b"", b"\xc1" * 10, b"\x92\x01\x02"]:
        sock.send(frame)
    sock.send_multipart([b"a", b"b"])
    deadline = time.monotonic() + DEADLINE_S
    while (
        cluster.metric("pdserve_router_protocol_errors_total") < 6 and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    sock.close(0)
    ctx.term()
    assert cluster.metric("pdserve_router_protocol_errors_total") == 6
    out = client(cluster).completions.create(model=MODEL.name, prompt="still fine", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_prefix_routing_over_four_groups(cluster):
    c = client(cluster)
    placements = []
    for group in range(4):
        prefix = long_prompt(100 + group, words=200)
        for i in range(6):
            before = {w: len(prefill_requests(cluster.hub[w])) for w in ("p0", "p1")}
            # A suffix long enough to be worth a remote prefill (--remote-prefill-min-tokens).
            question = long_prompt(1000 * group + i, words=80)
            c.completions.create(model=MODEL.name, prompt=f"{prefix} {question}", max_tokens=1)
            after = {w: len(prefill_requests(cluster.hub[w])) for w in ("p0", "p1")}
            placements.append((group, i, next(w for w in after if after[w] > before[w])))
    hits = 0
    for group in range(4):
        first = next(w for g, i, w in placements if g == group and i == 0)
        hits += sum(1 for g, i, w in placements if g == group and i > 0 and w == first)
    assert hits / 20 >= 0.9
    assert cluster.metric("pdserve_router_decisions_total", reason="prefix_hit") >= 18


def placed(cluster, **kw) -> str:
    """Send one request; returns the prefill worker that got it."""
    before = {w: len(prefill_requests(cluster.hub[w])) for w in ("p0", "p1")}
    client(cluster).completions.create(model=MODEL.name, max_tokens=1, **kw)
    return next(w for w in before if len(prefill_requests(cluster.hub[w])) > before[w])


def test_sessions_stick(cluster):
    for s, session in enumerate(("alice", "bob", "carol", "erin")):
        seen = {
            placed(cluster, prompt=long_prompt(10 * s + i), extra_headers={"X-Session-ID": session})
            for i in range(4)
        }
        assert len(seen) == 1, session
    seen = {placed(cluster, prompt=long_prompt(90 + i), user="frank") for i in range(3)}
    assert len(seen) == 1


def test_a_hot_session_worker_overflows_elsewhere(cluster):
    home = placed(cluster, prompt=long_prompt(500), user="dave")
    hot = cluster.hub[home]
    hot.silent.set()  # it stops answering: dispatched requests pile up on it
    results = []

    def one(i: int) -> None:
        out = client(cluster).completions.create(
            model=MODEL.name, prompt=long_prompt(600 + i), max_tokens=2, user="dave"
        )
        results.append(out.choices[0].finish_reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + DEADLINE_S
    while cluster.metric("pdserve_router_decisions_total", reason="session_overflow") < 1:
        assert time.monotonic() < deadline, "no request overflowed"
        time.sleep(0.02)
    hot.silent.clear()
    for t in threads:
        t.join(30)
    assert results == ["length"] * 6
    other = cluster.hub["p1" if home == "p0" else "p0"]
    assert any(m.params.seed is None for m in prefill_requests(other))


def test_worker_joining_mid_load_takes_requests():
    with router_server(MODEL) as router:
        hub: dict = {}
        p0, _ = start_fakes(router, hub, [("p0", "prefill"), ("d0", "decode")], tick=0.02)
        c = client(router)
        results = []

        def load(i: int) -> None:
            out = c.completions.create(model=MODEL.name, prompt=long_prompt(200 + i), max_tokens=20)
            results.append(out.choices[0].finish_reason)

        # p0 is busy: the first requests queue there unanswered, so it stays loaded however
        # slowly the machine runs the rest.
        p0.hold_prefills.set()
        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: len(prefill_requests(p0)) == 4)
        (p1,) = start_fakes(router, hub, [("p1", "prefill")], tick=0.02)
        router.wait_for_workers(2, 1)
        more = [threading.Thread(target=load, args=(i,)) for i in range(4, 10)]
        for t in more:
            t.start()
        wait_until(lambda: len(prefill_requests(p0)) + len(prefill_requests(p1)) == 10)
        p0.hold_prefills.clear()
        for t in threads + more:
            t.join(60)
        assert results == ["length"] * 10
        assert prefill_requests(p1)


@pytest.mark.slow
def test_silent_decode_worker_is_removed_and_its_streams_migrate():
    with router_server(MODEL, heartbeat_timeout=4.0) as router:
        hub: dict = {}
        _, d0, d1 = start_fakes(
            router, hub, [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")], tick=0.05
        )
        c = client(router)
        streams = [
            c.completions.create(
                model=MODEL.name, prompt=long_prompt(300 + i), max_tokens=30, stream=True
            )
            for i in range(4)
        ]
        texts = [[] for _ in streams]
        # Read a few chunks of each, then silence the decode worker holding most of them.
        for i, s in enumerate(streams):
            for _ in range(3):
                texts[i].append(next(s).choices[0].text)
        victim = d0 if d0.jobs else d1
        victim.silent.set()
        finishes = []
        for i, s in enumerate(streams):
            for chunk in s:
                texts[i].append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
        assert finishes == ["length"] * 4
        expected = client(router).completions.create(model=MODEL.name, prompt=[1], max_tokens=30)
        assert all(
            "".join(t) == expected.choices[0].text for t in texts
        )  # no token lost or doubled
        router.wait_for_workers(1, 1)
        assert router.metric("pdserve_router_redispatches_total", kind="migrate") >= 1


@pytest.mark.slow
def test_silent_prefill_worker_requests_go_elsewhere():
    with router_server(MODEL, heartbeat_timeout=4.0) as router:
        hub: dict = {}
        p0, p1, _ = start_fakes(
            router, hub, [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")]
        )
        p0.silent.set()
        p1.silent.set()
        results = []

        def one(i: int) -> None:
            out = client(router).completions.create(
                model=MODEL.name, prompt=long_prompt(i), max_tokens=2
            )
            results.append(out.choices[0].finish_reason)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # All four are dispatched while both workers are silent, so p0 holds some of them.
        wait_until(lambda: router.metric("pdserve_router_inflight_requests") == 4)
        p1.silent.clear()  # p1 comes back well before its timeout; p0 stays silent and is removed
        for t in threads:
            t.join(30)
        assert results == ["length"] * 4
        assert router.metric("pdserve_router_workers_removed_total", cause="heartbeat_timeout") >= 1
        # The removed worker is told to drop what it held (it may only have been slow).
        p0.silent.clear()
        deadline = time.monotonic() + DEADLINE_S
        while True:
            held = {m.request_id for m in prefill_requests(p0)}
            aborted = {m.request_id for m in p0.received if isinstance(m, AbortRequest)}
            if held and held <= aborted:
                break
            assert time.monotonic() < deadline, f"held {held}, aborted {aborted}"
            time.sleep(0.05)


@pytest.mark.slow
def test_a_request_that_stalls_is_sent_again_and_completes():
    """A handoff lost on the way: the client has its first token and the decode worker never
    hears of the request. After --request-stall-timeout without a token the router sends it
    again, under a new id, and the stream completes."""
    with router_server(MODEL, request_stall_timeout=1.0) as router:
        hub: dict = {}
        p0, d0 = start_fakes(router, hub, [("p0", "prefill"), ("d0", "decode")])
        router.wait_for_workers(1, 1)
        p0.handoffs_to_lose = 1
        started = time.monotonic()
        stream = client(router).completions.create(
            model=MODEL.name, prompt=long_prompt(7), max_tokens=6, stream=True
        )
        finishes = [c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert time.monotonic() - started >= 1.0
        assert router.metric("pdserve_router_stalled_requests_total") == 1
        # It had its first token, so it moves to a decode worker with it, as a new attempt.
        [first] = [m.request_id for m in prefill_requests(p0)]
        again = [m for m in d0.received if isinstance(m, DecodeRequest)]
        assert [m.request_id for m in again] == [first + "#1"]
        assert len(again[0].output_token_ids) == 1


@pytest.mark.slow
def test_a_request_queued_past_the_stall_window_on_a_working_worker_is_not_sent_again():
    """A prompt that waits on its prefill worker (queued behind others, or in chunk after chunk)
    has no token for longer than --request-stall-timeout; the worker's heartbeats list it while
    the worker steps, so it is not sent again: it completes once, from where it was sent."""
    with router_server(MODEL, request_stall_timeout=1.5) as router:
        hub: dict = {}
        p0, p1, _ = start_fakes(
            router, hub, [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")]
        )
        router.wait_for_workers(2, 1)
        # Held prefills are work a worker steps through (the fakes count a step a tick).
        p0.hold_prefills.set()
        p1.hold_prefills.set()
        done = threading.Event()
        answers: list = []

        def one() -> None:
            answers.append(
                client(router).completions.create(
                    model=MODEL.name, prompt=long_prompt(11), max_tokens=3
                )
            )
            done.set()

        threading.Thread(target=one, daemon=True).start()
        wait_until(lambda: p0.held or p1.held)
        # Three windows with no token: the stall timer would have sent it again twice by now.
        assert not done.wait(4.5)
        for worker in (p0, p1):
            worker.hold_prefills.clear()
        assert done.wait(30) and answers[0].choices[0].finish_reason == "length"
        assert router.metric("pdserve_router_stalled_requests_total") == 0
        sent = prefill_requests(p0) + prefill_requests(p1)
        assert len(sent) == 1 and "#" not in sent[0].request_id
        assert not [m for w in (p0, p1) for m in w.received if isinstance(m, AbortRequest)]


@pytest.mark.slow
def test_a_worker_that_heartbeats_but_takes_no_step_has_its_requests_sent_again():
    """A stuck worker whose heartbeats go on (its step loop wedged, its heartbeat thread alive)
    is never taken out for silence: after --request-stall-timeout without a step of it, its
    request is aborted there and sent again elsewhere, and completes."""
    with router_server(MODEL, request_stall_timeout=1.5) as router:
        hub: dict = {}
        p0, p1, _ = start_fakes(
            router, hub, [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")]
        )
        router.wait_for_workers(2, 1)
        p0.wedged.set()
        p1.wedged.set()
        answers: list = []
        thread = threading.Thread(
            target=lambda: answers.append(
                client(router).completions.create(
                    model=MODEL.name, prompt=long_prompt(12), max_tokens=3
                )
            ),
            daemon=True,
        )
        thread.start()
        wait_until(lambda: p0.held or p1.held)
        stuck, other = (p0, p1) if p0.held else (p1, p0)
        other.wedged.clear()
        thread.join(30)
        assert answers and answers[0].choices[0].finish_reason == "length"
        assert router.metric("pdserve_router_stalled_requests_total") == 1
        [first] = [m.request_id for m in stuck.held]
        assert [m.request_id for m in prefill_requests(other)] == [first + "#1"]
        assert [m.request_id for m in stuck.received if isinstance(m, AbortRequest)] == [first]
        assert router.metric("pdserve_router_workers_removed_total", cause="heartbeat_timeout") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_on_every_worker_holding_the_request(stream):
    with router_server(MODEL) as router:
        hub: dict = {}
        _, d0 = start_fakes(router, hub, [("p0", "prefill"), ("d0", "decode")], tick=0.05)
        body = {"model": MODEL.name, "prompt": long_prompt(9), "max_tokens": 500, "stream": stream}
        with httpx.Client(base_url=router.base_url, timeout=0.5) as h:
            if stream:
                with h.stream("POST", "/v1/completions", json=body) as r:
                    next(r.iter_lines())
            else:
                with pytest.raises(httpx.ReadTimeout):
                    h.post("/v1/completions", json=body)
        deadline = time.monotonic() + DEADLINE_S
        while not any(isinstance(m, AbortRequest) for m in d0.received):
            assert time.monotonic() < deadline, "no AbortRequest reached the decode worker"
            time.sleep(0.02)
        while d0.jobs:  # the worker dropped it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert router.metric("pdserve_router_aborts_total", cause="client_disconnected") == 1


def test_a_registration_sent_again_is_acknowledged_and_a_new_incarnation_replaces_the_worker():
    """A worker sends its registration again until it is acknowledged: the same incarnation is
    the same process (acknowledged, nothing removed), a new one under the same id a restart."""
    with router_server(MODEL) as router, zmq.Context() as ctx:
        config = router.app.state.config
        model = config.worker_model or config.served_model_name
        link = ControlSocket(ctx, router.control, "p0")
        try:
            for incarnation in ("first", "first"):
                assert register_worker(link, "p0", ROLE_PREFILL, model, 16, incarnation).accepted
            router.wait_for_workers(prefill=1, decode=0)
            removed = "pdserve_router_workers_removed_total"
            assert router.metric(removed, cause="re_registered") == 0
            assert register_worker(link, "p0", ROLE_PREFILL, model, 16, "restarted").accepted
            assert router.metric(removed, cause="re_registered") == 1
            router.wait_for_workers(prefill=1, decode=0)
        finally:
            link.sock.close()


def test_a_checkout_that_is_not_installed_reports_its_pyproject_version(monkeypatch):
    """The GPU check runs pdserve from a checkout on PYTHONPATH, with no distribution metadata:
    /version then says the checkout's version (the router used to fail at import there)."""

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with PYPROJECT.open("rb") as file:
        assert pdserve_version() == tomllib.load(file)["project"]["version"]
