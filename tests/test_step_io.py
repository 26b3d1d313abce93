"""StepIO: a worker's sockets are served while its main loop is inside a step, and only then."""

from __future__ import annotations

import threading
import time

import zmq

from common.service.step_io import StepIO

# Generous: a loaded 2-core machine may take a while to schedule the helper thread.
DEADLINE_S = 10.0


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
