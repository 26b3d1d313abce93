"""StepIO: a worker's sockets are served while its main loop is inside a step, and only then."""

from __future__ import annotations

import threading
import time

import zmq

import common.service.step_io as step_io_module
from common.cluster_auth import ClusterAuth
from common.messages import decode
from common.protocol import RequestFailed
from common.service.router_link import RouterLink
from common.service.step_io import StepIO

# Generous: a loaded 2-core machine may take a while to schedule the helper thread.
DEADLINE_S = 30.0


def socket_pair(context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    server = context.socket(zmq.PULL)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = context.socket(zmq.PUSH)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def test_traffic_is_served_inside_a_step_and_left_alone_outside() -> None:
    context = zmq.Context()
    server, client = socket_pair(context)
    served: list[bytes] = []
    arrived = threading.Event()
    serving_thread: list[str] = []

    def serve() -> None:
        while True:
            try:
                served.append(server.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        serving_thread.append(threading.current_thread().name)
        arrived.set()

    step_io = StepIO(serve, [server])
    try:
        # Outside a step nothing reads the socket: the message waits for the main loop.
        client.send(b"between steps")
        assert server.poll(int(DEADLINE_S * 1000))
        assert not arrived.wait(0.2)
        assert served == []
        assert server.recv() == b"between steps"

        # Inside a step the helper serves what arrives, before the step ends.
        with step_io:
            client.send(b"during a step")
            assert arrived.wait(DEADLINE_S)
        assert served == [b"during a step"]
        assert serving_thread == ["step-io"]

        # After the block the helper has let go again.
        arrived.clear()
        client.send(b"after the step")
        assert server.poll(int(DEADLINE_S * 1000))
        assert not arrived.wait(0.2)
    finally:
        step_io.close()
        server.close()
        client.close()
        context.term()


def test_a_failing_serve_does_not_stop_the_helper() -> None:
    context = zmq.Context()
    server, client = socket_pair(context)
    calls: list[int] = []
    second = threading.Event()

    def serve() -> None:
        server.recv(zmq.NOBLOCK)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a peer sent something odd")
        second.set()

    step_io = StepIO(serve, [server])
    try:
        with step_io:
            client.send(b"one")
            client.send(b"two")
            assert second.wait(DEADLINE_S)
        assert len(calls) == 2
    finally:
        step_io.close()
        server.close()
        client.close()
        context.term()


def test_sockets_asked_afresh_come_and_go_between_steps(caplog) -> None:
    """A decode worker's senders come and go: the sockets to serve are asked for at each step's
    start. A socket that appears is served in the next step; one that ``serve`` closes (a peer
    dropped) is polled no more, with no error."""
    context = zmq.Context()
    server, client = socket_pair(context)
    current: list[zmq.Socket] = []
    served = threading.Event()
    polled_after_close = threading.Event()
    pulses_after_serve = [0]

    def serve() -> None:
        assert server.recv(zmq.NOBLOCK) == b"pages"
        server.close()
        served.set()

    def pulse() -> None:
        # The helper pulses after each poll: a second pulse after the serve means a poll came
        # after the socket closed, and went through (a failed poll raises before its pulse).
        if served.is_set():
            pulses_after_serve[0] += 1
            if pulses_after_serve[0] >= 2:
                polled_after_close.set()

    step_io = StepIO(serve, lambda: current, pulse=pulse)
    try:
        client.send(b"pages")
        with step_io:  # no sockets yet: nothing is served
            assert not served.wait(0.2)
        current.append(server)
        with step_io:
            assert served.wait(DEADLINE_S)
            assert polled_after_close.wait(DEADLINE_S)
        assert "failed" not in caplog.text
    finally:
        step_io.close()
        client.close()
        context.term()


def test_pulses_go_on_inside_a_long_step_only() -> None:
    """A worker's heartbeat rides on ``pulse``: it must keep beating while a step runs, however
    long, and leave the link to the main loop outside steps. Without sockets to serve, the
    helper waits on the step's end itself rather than on a poll."""
    pulses: list[float] = []
    enough = threading.Event()

    def pulse() -> None:
        pulses.append(time.monotonic())
        if len(pulses) >= 5:
            enough.set()

    step_io = StepIO(None, [], pulse=pulse)
    try:
        time.sleep(0.2)
        assert not pulses  # no step yet
        with step_io:
            assert enough.wait(DEADLINE_S)
        count = len(pulses)
        time.sleep(0.2)
        assert len(pulses) == count  # none outside a step
    finally:
        step_io.close()


def test_output_waiting_at_a_steps_start_is_sent_beside_the_forward(monkeypatch) -> None:
    """With ``pulse_now`` true at a step's start the helper is woken for it at once, not at its
    next timer (made an hour here, so only the wake-up can run the pulse within the step)."""
    monkeypatch.setattr(step_io_module, "_PULSE_S", 3600.0)
    waiting = True
    pulsed = threading.Event()
    step_io = StepIO(None, [], pulse=pulsed.set, pulse_now=lambda: waiting)
    try:
        with step_io:
            assert pulsed.wait(DEADLINE_S)
        waiting, pulsed = False, threading.Event()
        step_io._pulse = pulsed.set
        with step_io:
            time.sleep(0.2)
        assert not pulsed.is_set()  # nothing waiting: no wake-up
    finally:
        step_io.close()


def test_with_the_pulse_inline_the_loop_pulses_and_the_helper_only_serves(monkeypatch) -> None:
    """Beside a GPU: the main loop pulses itself once the forward is launched (the previous
    step's output, a heartbeat); the helper never pulses, and wakes for a step only to serve its
    sockets (a prompt's KV pages, received off the step's thread)."""
    monkeypatch.setattr(step_io_module, "_PULSE_S", 0.01)  # timers a helper might pulse on
    context = zmq.Context()
    server, client = socket_pair(context)
    current: list[zmq.Socket] = []
    pulses: list[str] = []
    served = threading.Event()
    serving_thread: list[str] = []

    def serve() -> None:
        assert server.recv(zmq.NOBLOCK) == b"pages"
        serving_thread.append(threading.current_thread().name)
        served.set()

    def pulse() -> None:
        pulses.append(threading.current_thread().name)

    step_io = StepIO(serve, lambda: current, pulse=pulse, pulse_now=lambda: True,
                     pulse_inline=True)  # fmt: skip
    try:
        me = threading.current_thread().name
        with step_io:
            time.sleep(0.1)  # ten of the helper's timers: none pulses
            assert pulses == []
            step_io.device_launched()
        assert pulses == [me]
        current.append(server)
        client.send(b"pages")
        with step_io:
            assert served.wait(DEADLINE_S)
            step_io.device_launched()
        assert serving_thread == ["step-io"]
        assert pulses == [me, me]
    finally:
        step_io.close()
        server.close()
        client.close()
        context.term()


def test_router_link_sends_queued_messages_first_and_in_order() -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = RouterLink(context, f"tcp://127.0.0.1:{port}", "w-1", ClusterAuth(None, lambda _: None))
    try:
        link.send_soon(RequestFailed("a", "x", False))
        link.send_soon(RequestFailed("b", "x", False))
        assert link.has_deferred()
        link.send(RequestFailed("c", "x", False))  # the queued ones go first
        link.send_soon(RequestFailed("d", "x", False))
        link.flush()
        assert not link.has_deferred()
        received = []
        while len(received) < 4 and router.poll(int(DEADLINE_S * 1000)):
            received.append(decode(router.recv_multipart()[1]).request_id)
        assert received == ["a", "b", "c", "d"]
    finally:
        link.close()
        router.close()
        context.term()
