"""Live role switches, the router's side: ``POST /v1/workers/{id}/role`` (auth, bad input,
refusals, the answer waited for or not), the wire messages, and the re-registration that moves
nothing. Workers here are control sockets the test drives, so each step is seen.

The worker's side, on real engines under a stream of requests, is in
``test_role_switch_cluster.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from router_fakes import DEADLINE_S, ControlSocket, register_worker, router_server
from test_drain import Sent, delta, submit, two_of_each
from test_router_registry import reg

from common.cluster_auth import ClusterAuth
from common.messages import decode, encode
from common.model.default_model import resolve_model_path
from common.protocol import (
    SWITCH_FAILED,
    SWITCH_REFUSED,
    SWITCH_SWITCHED,
    AbortRequest,
    CacheEvents,
    DecodeRequest,
    RegisterAck,
    RoleSwitchResult,
    SwitchRole,
)
from common.sampling_params import SamplingParams
from common.service.router_link import RouterLink
from router.dispatcher import Dispatcher, Generation
from router.errors import APIError
from router.role_switch import STATUS_SWITCHED, RoleSwitches, SwitchOutcome

MODEL = resolve_model_path(None)
KEY = "role-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


# -- the messages ------------------------------------------------------------------------------


def test_role_switch_messages_round_trip_and_are_checked():
    for msg in (
        SwitchRole("switch-0", "decode", 30.0),
        RoleSwitchResult("w", "switch-0", "decode", SWITCH_SWITCHED),
        RoleSwitchResult("w", "switch-0", "prefill", SWITCH_FAILED, "drain timeout"),
        RoleSwitchResult("w", "switch-0", "prefill", SWITCH_REFUSED, "cannot"),
    ):
        assert decode(encode(msg)) == msg
    bad = [
        lambda: SwitchRole("s", "encode", 30.0),
        lambda: SwitchRole("s", "decode", 0.0),
        lambda: SwitchRole("s", "decode", float("nan")),
        lambda: SwitchRole("s", "decode", 1e9),
        lambda: RoleSwitchResult("w", "s", "decode", "maybe"),
        lambda: RoleSwitchResult("w", "s", "decode", SWITCH_SWITCHED, "but an error"),
        lambda: RoleSwitchResult("w", "s", "decode", SWITCH_FAILED),  # a failure says why
    ]
    for make in bad:
        with pytest.raises(ValueError):
            make()


# -- a router and workers driven by hand -------------------------------------------------------


class Worker:
    """A registered worker whose control socket the test reads and answers."""

    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: str, role: str) -> None:
        self.worker_id, self.role = worker_id, role
        self.incarnation = secrets.token_hex(8)
        self.sock = ControlSocket(ctx, endpoint, worker_id)
        ack = register_worker(self.sock, worker_id, role, MODEL.name, 16, self.incarnation)
        assert ack.accepted, ack.reason
        self.sock.send(CacheEvents(worker_id, [], [], reset=True))

    def next_switch(self) -> SwitchRole:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if self.sock.sock.poll(50):
                msg = decode(self.sock.sock.recv())
                if isinstance(msg, SwitchRole):
                    return msg
        raise TimeoutError(f"{self.worker_id}: no SwitchRole")

    def switch(self, order: SwitchRole) -> None:
        """Do as a worker does once drained: register in the new role, then answer."""
        ack = register_worker(
            self.sock, self.worker_id, order.role, MODEL.name, 16, self.incarnation
        )
        assert isinstance(ack, RegisterAck) and ack.accepted, ack.reason
        self.role = order.role
        self.sock.send(
            RoleSwitchResult(self.worker_id, order.operation_id, order.role, SWITCH_SWITCHED)
        )

    def fail(self, order: SwitchRole, outcome: str, error: str) -> None:
        self.sock.send(
            RoleSwitchResult(self.worker_id, order.operation_id, self.role, outcome, error)
        )


@contextlib.contextmanager
def cluster(*specs: tuple[str, str], **overrides) -> Iterator[tuple[object, dict[str, Worker]]]:
    with router_server(MODEL, api_key=KEY, **overrides) as router:
        ctx = zmq.Context()
        try:
            workers = {wid: Worker(ctx, router.control, wid, role) for wid, role in specs}
            yield router, workers
        finally:
            for worker in workers.values():
                worker.sock.sock.close(0)
            ctx.term()


def listing(router) -> dict[str, dict]:
    with router.client() as http:
        pools = http.get("/v1/workers", headers=AUTH).json()
    return {w["id"]: w for role in ("prefill", "decode") for w in pools[role]}


def post_role(router, worker_id: str, body: dict, headers: dict | None = AUTH):
    with router.client() as http:
        return http.post(f"/v1/workers/{worker_id}/role", json=body, headers=headers or {})


def in_background(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


# -- the endpoint ------------------------------------------------------------------------------


def test_role_route_asks_for_the_api_key_and_refuses_bad_input():
    with cluster(("p0", "prefill"), ("d0", "decode"), ("d1", "decode")) as (router, _):
        assert post_role(router, "d0", {"role": "prefill"}, headers=None).status_code == 401
        wrong = {"Authorization": "Bearer x"}
        assert post_role(router, "d0", {"role": "prefill"}, wrong).status_code == 401
        for body in (
            {},
            {"role": "encode"},
            {"role": "prefill", "drain_timeout_s": 0},
            {"role": "prefill", "drain_timeout_s": -3},
            {"role": "prefill", "drain_timeout_s": 1e9},
            {"role": "prefill", "colour": "red"},
            {"role": "prefill", "wait": "soon"},
        ):
            r = post_role(router, "d0", body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        with router.client() as http:
            r = http.post("/v1/workers/d0/role", content=b"{not json", headers=AUTH)
            assert r.status_code == 400
        r = post_role(router, "nobody", {"role": "prefill"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
        # Nothing of that touched a worker.
        assert all(w["switching"] is None for w in listing(router).values())
        assert listing(router)["d0"]["role"] == "decode"


def test_a_switch_to_the_role_served_is_done_already_and_the_last_decoder_stays():
    with cluster(("p0", "prefill"), ("d0", "decode")) as (router, _):
        r = post_role(router, "p0", {"role": "prefill"})
        assert r.status_code == 200 and r.json()["status"] == "unchanged"
        r = post_role(router, "d0", {"role": "prefill"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "last_decode_worker"
        assert listing(router)["d0"]["role"] == "decode"
        assert (
            router.metric(
                "pdserve_router_role_switches_total",
                direction="decode_to_prefill",
                outcome=SWITCH_REFUSED,
            )
            == 1
        )


def test_a_switch_waited_for_reregisters_the_worker_in_its_new_role():
    with cluster(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")) as (router, workers):
        thread, out = in_background(lambda: post_role(router, "p1", {"role": "decode"}))
        order = workers["p1"].next_switch()
        assert order.role == "decode" and order.drain_timeout_s > 0
        # Meanwhile it is listed as switching, and a second switch is refused.
        assert listing(router)["p1"]["switching"] == {"to": "decode"}
        r = post_role(router, "p1", {"role": "decode"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "role_switch_in_progress"
        workers["p1"].switch(order)
        thread.join(DEADLINE_S)
        answer = out[0]
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["status"] == "switched" and body["from"] == "prefill" and body["to"] == "decode"
        assert body["id"] == order.operation_id
        entry = listing(router)["p1"]
        assert entry["role"] == "decode" and entry["switching"] is None
        assert entry["last_role_switch"]["status"] == "switched"
        assert (
            router.metric(
                "pdserve_router_role_switches_total",
                direction="prefill_to_decode",
                outcome="switched",
            )
            == 1
        )
        assert (
            router.metric("pdserve_router_role_switch_seconds_count", direction="prefill_to_decode")
            == 1
        )
        # A plain re-registration of a restarted process (a new incarnation) is no switch.
        assert router.metric("pdserve_router_workers_removed_total", cause="re_registered") == 0


def test_a_switch_not_waited_for_answers_202_and_shows_in_the_worker_list():
    with cluster(("p0", "prefill"), ("d0", "decode"), ("d1", "decode")) as (router, workers):
        r = post_role(router, "d1", {"role": "prefill", "wait": False})
        assert r.status_code == 202 and r.json()["status"] == "switching"
        order = workers["d1"].next_switch()  # d1 holds nothing: it is told at once
        assert listing(router)["d1"]["switching"] == {"to": "prefill"}
        workers["d1"].switch(order)
        deadline = time.monotonic() + DEADLINE_S
        while (listing(router)["d1"]["last_role_switch"] or {}).get("status") != "switched":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert listing(router)["d1"]["role"] == "prefill"


def test_a_switch_the_worker_fails_or_refuses_leaves_it_in_its_old_role():
    with cluster(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")) as (router, workers):
        for outcome, status, code in (
            (SWITCH_FAILED, 409, "role_switch_failed"),
            (SWITCH_REFUSED, 400, "role_switch_refused"),
        ):
            thread, out = in_background(lambda: post_role(router, "p1", {"role": "decode"}))
            order = workers["p1"].next_switch()
            workers["p1"].fail(order, outcome, "building the decode role: no port")
            thread.join(DEADLINE_S)
            r = out[0]
            assert r.status_code == status and r.json()["error"]["code"] == code, r.text
            assert "no port" in r.json()["error"]["message"]
            entry = listing(router)["p1"]
            assert entry["role"] == "prefill" and entry["switching"] is None
            assert entry["last_role_switch"]["status"] == outcome
            assert (
                router.metric(
                    "pdserve_router_role_switches_total",
                    direction="prefill_to_decode",
                    outcome=outcome,
                )
                == 1
            )


def test_a_switch_the_worker_never_answers_times_out_and_routing_to_it_resumes(monkeypatch):
    import router.role_switch as role_switch

    monkeypatch.setattr(role_switch, "_ANSWER_SLACK_S", 0.2)
    with cluster(("p0", "prefill"), ("d0", "decode"), ("d1", "decode")) as (router, _):
        r = post_role(router, "d1", {"role": "prefill", "drain_timeout_s": 0.3})
        assert r.status_code == 409 and r.json()["error"]["code"] == "role_switch_failed"
        assert "serves as decode" in r.json()["error"]["message"]
        entry = listing(router)["d1"]
        assert entry["role"] == "decode" and entry["switching"] is None
        registry = router.app.state.registry
        assert "d1" in {view.worker_id for view in registry.view().decode}


# -- the drain's end: finished, failed, or moved off -------------------------------------------


def busy_decoder() -> tuple[Dispatcher, RoleSwitches, Sent, Generation, str, str]:
    """Two workers of each role, a request decoding on one of the decode workers (the holder):
    the dispatcher, the role switches, the outbox, the request, the holder and the other
    decode worker."""
    dispatcher, sent, metrics = two_of_each()
    gen = submit(dispatcher, "running")
    holder = gen.decode_worker
    assert holder is not None
    now = time.monotonic()
    dispatcher.on_message(gen.prefill_worker, delta(gen, 0, 1, first=True), now)
    dispatcher.on_message(holder, delta(gen, 1, 2), now)
    switches = RoleSwitches(
        dispatcher.registry, sent, metrics, settled=dispatcher.dispatch_waiting,
        move_off=dispatcher.move_off,
    )  # fmt: skip
    dispatcher.on_role_switch_result = switches.on_result
    return dispatcher, switches, sent, gen, holder, "d2" if holder == "d1" else "d1"


async def answer_switch(dispatcher: Dispatcher, sent: Sent, worker_id: str) -> None:
    """Play the worker: once told to switch, register in the new role and say so."""
    while not any(isinstance(m, SwitchRole) for m in sent.to(worker_id)):
        await asyncio.sleep(0.005)
    order = next(m for m in sent.to(worker_id) if isinstance(m, SwitchRole))
    now = time.monotonic()
    dispatcher.on_message(worker_id, reg(worker_id, order.role), now)
    dispatcher.on_message(
        worker_id, RoleSwitchResult(worker_id, order.operation_id, order.role, SWITCH_SWITCHED), now
    )


def test_a_decode_drain_past_its_timeout_fails_the_switch_and_the_worker_serves_on():
    _, switches, sent, gen, holder, _ = busy_decoder()

    async def run():
        started = switches.begin(holder, "prefill")
        assert not isinstance(started, SwitchOutcome)
        with pytest.raises(APIError) as refused:
            await switches.finish(started, 0.05)
        return refused.value

    error = asyncio.run(run())
    assert error.status == 409 and error.code == "role_switch_failed"
    assert "drain timeout: 1 requests" in error.message and "serves as decode" in error.message
    # Never told to switch; its request stays with it, and it is routed to again.
    assert not any(isinstance(m, SwitchRole | AbortRequest) for m in sent.to(holder))
    state = switches.registry.workers[holder]
    assert gen.decode_worker == holder and state.switching_to is None and state.serving


def test_a_decode_drain_past_its_timeout_with_migrate_moves_the_requests_and_switches():
    dispatcher, switches, sent, gen, holder, other = busy_decoder()

    async def run() -> SwitchOutcome:
        started = switches.begin(holder, "prefill", migrate=True)
        assert not isinstance(started, SwitchOutcome)
        worker = asyncio.create_task(answer_switch(dispatcher, sent, holder))
        outcome = await switches.finish(started, 0.05)
        await worker
        return outcome

    outcome = asyncio.run(run())
    assert outcome.status == STATUS_SWITCHED
    # The request moved on with its three tokens, and the holder heard of it first.
    assert gen.decode_worker == other and gen.retries == 1
    migrated = [m for m in sent.to(other) if isinstance(m, DecodeRequest)]
    assert migrated[-1].output_token_ids == [7, 7, 7]
    told = [type(m) for m in sent.to(holder) if isinstance(m, AbortRequest | SwitchRole)]
    assert told == [AbortRequest, SwitchRole]
    state = switches.registry.workers[holder]
    assert state.role == "prefill" and state.serving and not state.inflight
    assert state.last_role_switch["status"] == SWITCH_SWITCHED


def test_what_the_router_sends_right_after_a_registration_ack_is_not_lost():
    """A worker registering again in its new role is sent requests at once: those read in the
    same batch as the acknowledgement come out of the link's next ``receive``."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer not connected yet raises
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = RouterLink(context, f"tcp://127.0.0.1:{port}", "w-1", ClusterAuth(None, lambda _: None))
    params = SamplingParams(max_tokens=2)
    try:
        # All three wait on the worker's socket before it registers: its first read takes them
        # in one batch.
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                router.send_multipart([b"w-1", encode(RegisterAck(True, None, 0.5))])
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the worker's link never connected"
                time.sleep(0.01)
        for msg in (DecodeRequest("r-1", [1, 2, 3], params), AbortRequest("r-0")):
            router.send_multipart([b"w-1", encode(msg)])
        # Time to cross the loopback, so they come in one batch (what could lose them); the
        # assertions hold however they come.
        time.sleep(0.2)
        link.register(reg("w-1", "decode"), timeout=DEADLINE_S)
        assert link.heartbeat_interval == 0.5
        received: list = []
        deadline = time.monotonic() + DEADLINE_S
        while len(received) < 2 and time.monotonic() < deadline:
            received += link.receive()
            link.socket.poll(10)
        assert [type(m) for m in received] == [DecodeRequest, AbortRequest]
        assert not link.has_input()
    finally:
        link.close()
        router.close()
        context.term()
