"""Live role switches, the router's side: ``POST /v1/workers/{id}/role`` (auth, bad input,
refusals, the answer waited for or not), the wire messages, and the re-registration that moves
nothing. Workers here are control sockets the test drives, so each step is seen.

The worker's side, on real engines under a stream of requests, is in
``test_role_switch_cluster.py``.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from router_fakes import DEADLINE_S, ControlSocket, register_worker, router_server

from common.messages import decode, encode
from common.model.default_model import resolve_model_path
from common.protocol import (
    SWITCH_FAILED,
    SWITCH_REFUSED,
    SWITCH_SWITCHED,
    CacheEvents,
    RegisterAck,
    RoleSwitchResult,
    SwitchRole,
)

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
