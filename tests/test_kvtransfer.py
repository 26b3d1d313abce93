"""KV transfer between real processes on loopback, over both backends.

Senders run in a helper process (tests/kv_sender_process.py) with pools of seeded random pages;
the receivers run here and must end up with exactly the sender's bytes, or fail cleanly and by
their deadline when something goes wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from kv_sender_process import NUM_PAGES, fill_pool, make_layout, seed_of
from optional_backends import NIXL_INSTALLED, backend_params, needs_nixl
from prometheus_client import REGISTRY

from common.engine.kv_pool import KVPool
from common.messages import PROTOCOL_VERSION, ProtocolError, decode, encode, from_wire, to_wire
from kvtransfer import (
    TransferError,
    TransferParams,
    available_backends,
    create_receiver,
    create_sender,
)
from kvtransfer.messages import (
    FetchRequest,
    HandshakeReply,
    HandshakeRequest,
    PageData,
    ReleasePages,
)

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "tests" / "kv_sender_process.py"
BACKEND_NAMES = ["zmq", "nixl"]
SPEC_NAMES = [f"{b}:{d}" for b in BACKEND_NAMES for d in ("bf16", "fp8", "int8")]
BACKENDS = backend_params(*BACKEND_NAMES)
SPECS = backend_params(*SPEC_NAMES)


class SenderProcess:
    """A kv_sender_process.py child: commands in, replies and release events out."""

    def __init__(self, specs: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), *specs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._replies: queue.Queue = queue.Queue()
        self._events: queue.Queue = queue.Queue()
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.endpoints = {}
        for _ in specs:
            event = self.wait_event("ready", timeout=60)
            self.endpoints[event["key"]] = event["endpoint"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            record["t"] = time.monotonic()
            (self._replies if "id" in record else self._events).put(record)

    def command(self, key: str, cmd: str, **fields) -> dict:
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "key": key, "cmd": cmd, **fields})
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self._replies.get(timeout=30)
        assert reply["id"] == self._next_id
        return reply

    def publish(self, key: str, transfer_id: str, page_ids: list[int], lease: float):
        reply = self.command(
            key, "publish", transfer_id=transfer_id, page_ids=page_ids, lease=lease
        )
        return from_wire(TransferParams, reply["params"]), time.monotonic()

    def wait_event(self, event: str, timeout: float, **match) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            record = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            if record["event"] == event and all(record.get(k) == v for k, v in match.items()):
                return record

    def wait_released(self, key: str, transfer_id: str, timeout: float) -> float:
        return self.wait_event("released", timeout, key=key, transfer_id=transfer_id)["t"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def expected_pool(spec: str) -> KVPool:
    pool = KVPool(make_layout(spec.split(":")[1]), NUM_PAGES, "cpu")
    fill_pool(pool, seed_of(spec))
    return pool


def wait_result(receiver, transfer_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for result in receiver.poll():
            assert result.transfer_id == transfer_id, result
            return result
        time.sleep(0.001)
    raise AssertionError(f"no result for {transfer_id} within {timeout}s")


def bad_messages(backend: str, side: str) -> float:
    labels = {"backend": backend, "side": side}
    return REGISTRY.get_sample_value("pdserve_kv_transfer_bad_messages_total", labels) or 0.0


@pytest.fixture(scope="module")
def senders():
    process = SenderProcess([s for s in SPEC_NAMES if NIXL_INSTALLED or not s.startswith("nixl")])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def receivers():
    made = {}

    def get(spec: str, num_kv_heads: int = 2):
        key = (spec, num_kv_heads)
        if key not in made:
            backend, dtype = spec.split(":")
            pool = KVPool(make_layout(dtype, num_kv_heads), 24, "cpu")
            made[key] = create_receiver(backend, pool, engine_id=f"decode-{backend}-{dtype}")
        return made[key]

    yield get
    for receiver in made.values():
        receiver.close()


@pytest.mark.parametrize("spec", SPECS)
def test_fetch_copies_pages_exactly(senders, receivers, spec):
    receiver = receivers(spec)
    expected = expected_pool(spec)
    # Scattered pages, then runs of consecutive ones (which NIXL reads as one descriptor each);
    # the second fetch reuses the cached handshake.
    cases = [([5, 2, 11, 3, 15], [0, 17, 1, 4, 23]), ([4, 5, 6, 12, 13, 0], [9, 10, 11, 3, 4, 5])]
    for attempt, (src, dst) in enumerate(cases):
        transfer_id = f"copy-{spec}-{attempt}"
        params, _ = senders.publish(spec, transfer_id, src, lease=30)
        receiver.pool.data.zero_()
        receiver.start_fetch(transfer_id, params, dst, timeout=20)
        result = wait_result(receiver, transfer_id)
        assert result.ok, result.error
        assert result.num_pages == len(src)
        assert result.nbytes == len(src) * expected.layout.bytes_per_page
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(receiver.pool.page_bytes(d), expected.page_bytes(s))
            if expected.scales is not None:
                assert torch.equal(receiver.pool.scale_bytes(d), expected.scale_bytes(s))
        untouched = [b for b in range(receiver.pool.num_pages) if b not in dst]
        assert not receiver.pool.data[untouched].view(torch.uint8).any()
        # The acknowledgement frees the sender's pages long before the lease would.
        senders.wait_released(spec, transfer_id, timeout=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_transfers_lands_pages_and_leaves_the_result_for_poll(senders, receivers, backend):
    """What a decode worker's step helper calls while a step runs: the handshake, the request
    and the pages all move through ``serve_transfers`` alone, on the sockets
    ``transfer_sockets`` names, and the fetch's end waits for the main loop's ``poll``."""
    spec = f"{backend}:bf16"
    receiver, expected = receivers(spec), expected_pool(spec)
    src, dst = [7, 1, 8], [20, 2, 6]
    transfer_id = f"served-{spec}"
    params, _ = senders.publish(spec, transfer_id, src, lease=30)
    receiver.pool.data.zero_()
    receiver.start_fetch(transfer_id, params, dst, timeout=20)
    assert receiver.transfer_sockets()  # the sender's socket, to wake the helper on
    deadline = time.monotonic() + 60
    while True:  # until the sender hears the pages are in place
        assert time.monotonic() < deadline, "the pages did not arrive"
        receiver.serve_transfers()
        try:
            senders.wait_released(spec, transfer_id, timeout=0.01)
            break
        except queue.Empty:
            pass
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(receiver.pool.page_bytes(d), expected.page_bytes(s))
    [result] = receiver.poll()
    assert (result.transfer_id, result.ok, result.num_pages) == (transfer_id, True, len(src))
    assert receiver.poll() == []
    assert receiver.transfer_sockets() == []  # no fetch in flight: no helper woken for it


@needs_nixl
def test_page_runs():
    from kvtransfer.nixl_backend import page_runs

    runs = page_runs([4, 5, 6, 12, 13, 0, 1], [9, 10, 11, 3, 5, 6, 7])
    assert runs.tolist() == [[4, 9, 3], [12, 3, 1], [13, 5, 1], [0, 6, 2]]
    assert page_runs([2], [8]).tolist() == [[2, 8, 1]]
    # Long runs are cut into descriptors of at most max_run pages, for the read threads to share.
    assert page_runs(list(range(10, 17)), list(range(7)), max_run=3).tolist() == [
        [10, 0, 3],
        [13, 3, 3],
        [16, 6, 1],
    ]
    assert page_runs([0, 1, 2, 9, 10], [5, 6, 7, 8, 9], max_run=2).tolist() == [
        [0, 5, 2],
        [2, 7, 1],
        [9, 8, 2],
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_handshake_refuses_layout_mismatch(senders, receivers, backend):
    spec = f"{backend}:bf16"
    receiver = receivers(spec, num_kv_heads=4)
    params, _ = senders.publish(spec, f"mismatch-{backend}", [1, 2], lease=30)
    receiver.start_fetch(f"mismatch-{backend}", params, [0, 1], timeout=10)
    result = wait_result(receiver, f"mismatch-{backend}")
    assert not result.ok
    assert "KV layout mismatch" in result.error and "kv_heads" in result.error
    senders.wait_released(spec, f"mismatch-{backend}", timeout=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handshake_refuses_pages_of_another_scheme(senders, receivers, backend):
    # FP8 and int8 pages are the same size per element; only the layout's dtype tells them apart.
    receiver = receivers(f"{backend}:int8")
    params, _ = senders.publish(f"{backend}:fp8", f"scheme-{backend}", [1, 2], lease=30)
    receiver.start_fetch(f"scheme-{backend}", params, [0, 1], timeout=10)
    result = wait_result(receiver, f"scheme-{backend}")
    assert not result.ok
    assert "KV layout mismatch" in result.error and "int8_hadamard" in result.error
    senders.wait_released(f"{backend}:fp8", f"scheme-{backend}", timeout=10)


def test_handshake_refuses_protocol_mismatch(senders, receivers, monkeypatch):
    import kvtransfer.receiver

    monkeypatch.setattr(kvtransfer.receiver, "PROTOCOL_VERSION", 99)
    pool = KVPool(make_layout("bf16"), 4, "cpu")
    receiver = create_receiver("zmq", pool, engine_id="decode-from-the-future")
    try:
        params, _ = senders.publish("zmq:bf16", "version", [1], lease=30)
        receiver.start_fetch("version", params, [0], timeout=10)
        result = wait_result(receiver, "version")
        expected = f"protocol version mismatch: 99 here vs {PROTOCOL_VERSION} there"
        assert not result.ok and expected in result.error
    finally:
        receiver.close()


def test_start_fetch_rejects_bad_input(receivers):
    receiver = receivers("zmq:bf16")
    params = TransferParams("zmq", "tcp://127.0.0.1:1", "prefill", [1, 2], time.time() + 30)
    cases = [
        (params, [0], "destination"),
        (dataclasses.replace(params, backend="nixl"), [0, 1], "backend"),
        (params, [0, 99], "outside"),
        (params, [3, 3], "repeats"),
    ]
    for bad_params, dst, words in cases:
        with pytest.raises(TransferError, match=words):
            receiver.start_fetch("bad", bad_params, dst, timeout=1)
    assert receiver.poll() == []


def test_expired_lease_fails_without_traffic(receivers):
    receiver = receivers("zmq:bf16")
    params = TransferParams("zmq", "tcp://127.0.0.1:1", "prefill-x", [1], time.time() - 1)
    receiver.start_fetch("expired", params, [0], timeout=5)
    result = wait_result(receiver, "expired", timeout=5)
    assert not result.ok and "lease" in result.error


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_killed_mid_transfer_fails_by_deadline(backend):
    spec = f"{backend}:bf16"
    process = SenderProcess([spec])
    receiver = create_receiver(backend, KVPool(make_layout("bf16"), 16, "cpu"), "decode-kill")
    try:
        params, _ = process.publish(spec, "warm", [0], lease=30)
        receiver.start_fetch("warm", params, [0], timeout=20)
        assert wait_result(receiver, "warm").ok
        process.wait_released(spec, "warm", timeout=10)  # nothing else is on its way to it
        process.command(spec, "freeze_on_fetch")
        params, _ = process.publish(spec, "doomed", list(range(NUM_PAGES)), lease=30)
        started = time.monotonic()
        receiver.start_fetch("doomed", params, list(range(NUM_PAGES)[::-1]), timeout=2.0)
        while receiver.poll() == []:
            try:
                process.wait_event("frozen", timeout=0.01)
                break
            except queue.Empty:
                pass
        os.kill(process.proc.pid, signal.SIGKILL)
        result = wait_result(receiver, "doomed", timeout=10)
        elapsed = time.monotonic() - started
        assert not result.ok and "timed out" in result.error
        assert 1.9 <= elapsed < 5.0
    finally:
        receiver.close()
        process.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_gone_sender_releases_at_lease_end(senders, backend):
    spec = f"{backend}:fp8"
    params, published = senders.publish(spec, f"orphan-{backend}", [4, 5, 6], lease=1.5)
    # A receiver that asks for the pages and then disappears without acknowledging.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(params.endpoint)
    dealer.send(encode(FetchRequest(f"orphan-{backend}")))
    assert dealer.poll(10_000), "the sender never answered the fetch"
    dealer.close()
    released = senders.wait_released(spec, f"orphan-{backend}", timeout=10)
    assert 1.4 <= released - published < 5.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_abort(senders, receivers, backend):
    spec = f"{backend}:bf16"
    params, published = senders.publish(spec, f"withdrawn-{backend}", [7, 8], lease=30)
    senders.command(spec, "abort", transfer_id=f"withdrawn-{backend}")
    assert senders.wait_released(spec, f"withdrawn-{backend}", timeout=5) - published < 5
    receiver = receivers(spec)
    receiver.start_fetch(f"withdrawn-{backend}", params, [2, 3], timeout=10)
    result = wait_result(receiver, f"withdrawn-{backend}")
    assert not result.ok and "sender refused" in result.error


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_abort_releases_sender_pages(senders, receivers, backend):
    spec = f"{backend}:bf16"
    receiver = receivers(spec)
    params, published = senders.publish(spec, f"cancelled-{backend}", [9, 10], lease=30)
    receiver.start_fetch(f"cancelled-{backend}", params, [5, 6], timeout=10)
    receiver.abort(f"cancelled-{backend}")
    result = wait_result(receiver, f"cancelled-{backend}", timeout=5)
    assert not result.ok and result.error == "aborted"
    assert senders.wait_released(spec, f"cancelled-{backend}", timeout=10) - published < 10


GARBAGE = [
    [b""],
    [b"\xc1"],
    [msgpack.packb([1, 2, 3])],
    [msgpack.packb({"type": "kv.no_such_message"})],
    [msgpack.packb({"type": "kv.fetch_request", "transfer_id": 5})],
    [msgpack.packb({"type": "kv.fetch_request"})],
    [msgpack.packb({"type": "kv.fetch_request", "transfer_id": "x", "evil": 1})],
    [msgpack.packb({"type": "kv.fetch_request", "transfer_id": msgpack.ExtType(1, b"x")})],
    [b"\x80" * (2 << 20)],
    [encode(FetchRequest("x")), b"stray frame"],
    [encode(PageData("x", "i", 0, 1, 1, 0))],
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_on_sender_socket_is_counted_and_dropped(senders, receivers, backend):
    spec = f"{backend}:bf16"
    before = senders.command(spec, "bad_messages")["value"]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(senders.endpoints[spec])
    for frames in GARBAGE:
        dealer.send_multipart(frames)
    deadline = time.monotonic() + 30
    while senders.command(spec, "bad_messages")["value"] < before + len(GARBAGE):
        assert time.monotonic() < deadline, "the sender did not count every bad message"
        time.sleep(0.05)
    assert not dealer.poll(100), "the sender answered garbage"
    dealer.close()
    assert senders.command(spec, "bad_messages")["value"] == before + len(GARBAGE)
    # ... and it still serves.
    receiver = receivers(spec)
    params, _ = senders.publish(spec, f"after-garbage-{backend}", [12], lease=30)
    receiver.start_fetch(f"after-garbage-{backend}", params, [8], timeout=20)
    assert wait_result(receiver, f"after-garbage-{backend}").ok
    assert torch.equal(receiver.pool.page_bytes(8), expected_pool(spec).page_bytes(12))


def test_garbage_on_receiver_socket_is_counted_and_dropped():
    """A sender that talks nonsense before answering properly: the fetch still succeeds."""
    layout = make_layout("bf16")
    source = KVPool(layout, 4, "cpu")
    fill_pool(source, 7)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    receiver = create_receiver("zmq", KVPool(layout, 4, "cpu"), "decode-garbage")
    before = bad_messages("zmq", "receiver")
    try:
        params = TransferParams("zmq", f"tcp://127.0.0.1:{port}", "fake", [2], time.time() + 30)
        receiver.start_fetch("r", params, [1], timeout=20)

        def expect(kind):
            deadline = time.monotonic() + 30
            while not router.poll(1):
                receiver.poll()
                assert time.monotonic() < deadline
            identity, frame = router.recv_multipart()
            assert isinstance(decode(frame), kind)
            return identity

        identity = expect(HandshakeRequest)
        for frames in GARBAGE[:-2]:
            router.send_multipart([identity, *frames])
        router.send_multipart([identity, encode(ReleasePages("r", True))])  # wrong direction
        reply = HandshakeReply(PROTOCOL_VERSION, "fake", "i1", "zmq", layout, num_pages=4)
        router.send_multipart([identity, encode(reply)])
        router.send_multipart([identity, encode(reply)])  # a second reply is unexpected
        identity = expect(FetchRequest)
        header = PageData("r", "i1", 0, 1, layout.page_nbytes, 0)
        router.send_multipart([identity, encode(header), source.page_bytes(2).numpy()])
        result = wait_result(receiver, "r")
        assert result.ok, result.error
        assert torch.equal(receiver.pool.page_bytes(1), source.page_bytes(2))
        assert bad_messages("zmq", "receiver") == before + len(GARBAGE) - 2 + 2
    finally:
        receiver.close()
        router.close()


def test_transfer_params_round_trip_and_validation():
    params = TransferParams("nixl", "tcp://127.0.0.1:5", "prefill-0", [3, 1], 123.5)
    assert from_wire(TransferParams, to_wire(params)) == params
    raw = to_wire(params)
    raw["page_ids"] = ["3"]
    with pytest.raises(ProtocolError, match="page_ids"):
        from_wire(TransferParams, raw)
    with pytest.raises(ProtocolError, match="missing"):
        from_wire(TransferParams, {"backend": "zmq"})


def test_registry():
    assert available_backends() == ["nixl", "zmq"]
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_sender("carrier-pigeon", KVPool(make_layout("bf16"), 2, "cpu"), "p")


def test_publish_rejects_bad_input():
    sender = create_sender("zmq", KVPool(make_layout("bf16"), 4, "cpu"), "prefill-check")
    try:
        for page_ids, lease, words in [
            ([4], 1.0, "outside"),
            ([1, 1], 1.0, "repeats"),
            ([], 1.0, "empty"),
            ([1], 0.0, "lease"),
        ]:
            with pytest.raises(ValueError, match=words):
                sender.publish("x", page_ids, lease)
        sender.publish("x", [1], 1.0)
        with pytest.raises(ValueError, match="already published"):
            sender.publish("x", [2], 1.0)
    finally:
        sender.close()


def run_until(condition, *parties, timeout: float = 30.0):
    """Poll senders and receivers of this process together until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for party in parties:
            party.poll_into_log()
        time.sleep(0.001)


class Polled:
    """Keeps everything a sender's or receiver's poll() returned."""

    def __init__(self, side) -> None:
        self.side = side
        self.log: list = []

    def poll_into_log(self) -> None:
        self.log += self.side.poll()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_restarted_on_the_same_endpoint_is_handshaken_again(backend):
    layout = make_layout("bf16")
    first = KVPool(layout, 4, "cpu")
    fill_pool(first, 1)
    receiver = Polled(create_receiver(backend, KVPool(layout, 4, "cpu"), "decode-restart"))
    sender = Polled(create_sender(backend, first, "prefill-restart"))
    port = int(sender.side.endpoint.rsplit(":", 1)[1])
    try:
        params = sender.side.publish("before", [1], 30)
        receiver.side.start_fetch("before", params, [0], timeout=10)
        run_until(lambda: receiver.log, sender, receiver)
        assert receiver.log.pop().ok
        (peer_socket,) = receiver.side.poll_sockets()
        disconnects = peer_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sender.side.close()
        # A real restart takes seconds, long after the receiver saw the connection drop; a
        # request sent into the dying connection in the instant before is lost with it (and
        # its fetch times out), which is not what this test is about.
        try:
            assert disconnects.poll(10_000), "the receiver never saw the sender go"
        finally:
            peer_socket.disable_monitor()
            disconnects.close()
        second = KVPool(layout, 4, "cpu")
        fill_pool(second, 2)
        for _ in range(100):  # the old socket lets go of the port asynchronously
            try:
                sender = Polled(create_sender(backend, second, "prefill-restart", port=port))
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        params = sender.side.publish("after", [3], 30)
        receiver.side.start_fetch("after", params, [2], timeout=10)
        run_until(lambda: receiver.log, sender, receiver)
        result = receiver.log.pop()
        assert result.ok, result.error
        assert torch.equal(receiver.side.pool.page_bytes(2), second.page_bytes(3))
    finally:
        sender.side.close()
        receiver.side.close()


@needs_nixl
def test_sender_abort_waits_for_a_nixl_read_that_may_be_in_flight():
    """Once a READ may have started, the pages stay pinned until the receiver is done."""
    layout = make_layout("fp8")
    source = KVPool(layout, 4, "cpu")
    fill_pool(source, 3)
    sender = Polled(create_sender("nixl", source, "prefill-abort"))
    receiver = Polled(create_receiver("nixl", KVPool(layout, 4, "cpu"), "decode-abort"))
    try:
        params = sender.side.publish("r", [2, 3], 30)
        receiver.side.start_fetch("r", params, [0, 1], timeout=10)
        # Handshake, then the fetch request: stop as soon as the sender has said "go ahead".
        run_until(lambda: sender.side._leases["r"].in_flight, receiver, sender)
        sender.side.abort("r")
        sender.poll_into_log()
        assert sender.log == [], "released while the receiver may be reading"
        run_until(lambda: receiver.log and sender.log, receiver, sender)
        assert sender.log == ["r"]
        # The READ raced the abort; either outcome is sound, as the pages were still pinned.
        result = receiver.log[0]
        if result.ok:
            assert torch.equal(receiver.side.pool.page_bytes(0), source.page_bytes(2))
        else:
            assert "aborted by the sender" in result.error
    finally:
        sender.side.close()
        receiver.side.close()


def test_zmq_answer_split_across_messages(monkeypatch):
    import kvtransfer.zmq_backend

    layout = make_layout("fp8")
    monkeypatch.setattr(kvtransfer.zmq_backend, "MESSAGE_BYTES", 2 * layout.bytes_per_page)
    source = KVPool(layout, 8, "cpu")
    fill_pool(source, 4)
    sender = Polled(create_sender("zmq", source, "prefill-split"))
    receiver = Polled(create_receiver("zmq", KVPool(layout, 8, "cpu"), "decode-split"))
    try:
        src, dst = [6, 0, 3, 5, 1], [2, 7, 4, 0, 3]  # three messages: 2 + 2 + 1 pages
        receiver.side.start_fetch("r", sender.side.publish("r", src, 30), dst, timeout=10)
        run_until(lambda: receiver.log and sender.log, sender, receiver)
        assert receiver.log[0].ok, receiver.log[0].error
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(receiver.side.pool.page_bytes(d), source.page_bytes(s))
            assert torch.equal(receiver.side.pool.scale_bytes(d), source.scale_bytes(s))
    finally:
        sender.side.close()
        receiver.side.close()
