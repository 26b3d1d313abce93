"""The cluster secret on the internal sockets: holders talk, everyone else is refused (inside
libzmq, before a byte reaches pdserve) and counted."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from kv_sender_process import fill_pool, make_layout
from zmq_strangers import send_unless_refused

from common import cluster_auth
from common.cluster_auth import ClusterAuth, ClusterKeys, load_secret
from common.engine.kv_pool import KVPool
from kvtransfer import create_receiver, create_sender

pytestmark = pytest.mark.slow  # worker processes over real sockets

SECRET = "correct horse battery staple"


class Refusals:
    """A failure counter the tests can wait on."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._changed = threading.Condition()

    def __call__(self, name: str) -> None:
        with self._changed:
            self.counts[name] = self.counts.get(name, 0) + 1
            self._changed.notify_all()

    def wait_for(self, name: str, count: int, timeout: float = 30.0) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.counts.get(name, 0) >= count, timeout)
            return self.counts.get(name, 0)


@pytest.fixture
def server():
    """A PULL socket bound under the cluster secret, its auth and refusal counter."""
    refusals = Refusals()
    auth = ClusterAuth(SECRET, refusals)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    auth.server(pull, "handoff")
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield pull, f"tcp://127.0.0.1:{port}", refusals
    pull.close()
    auth.close()
    context.term()


def push(endpoint: str, secret: str | None, payload: bytes) -> None:
    """Connect a PUSH socket (with ``secret``'s keys, or none) and send ``payload``."""
    auth = ClusterAuth(secret, lambda name: None, quiet=True)
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    auth.client(sock)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    send_unless_refused(sock, payload)
    sock.close()
    context.term()


def test_keys_follow_from_the_secret():
    keys = ClusterKeys.from_secret(SECRET)
    assert keys == ClusterKeys.from_secret(SECRET)
    other = ClusterKeys.from_secret(SECRET + "!")
    assert other.client_public != keys.client_public and other.server_public != keys.server_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    with pytest.raises(ValueError, match="at least"):
        ClusterKeys.from_secret("short")


def test_secret_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(cluster_auth.SECRET_ENV, raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv(cluster_auth.SECRET_ENV, SECRET)
    assert load_secret(None) == SECRET
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    assert load_secret(str(path)) == "from-a-file-0123456789"  # the file wins
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    path.write_text("short")
    with pytest.raises(ValueError, match="at least"):
        load_secret(str(path))


def test_only_holders_of_the_secret_get_through(server):
    pull, endpoint, refusals = server
    # A peer in the clear, and one with another secret: both refused at the handshake.
    push(endpoint, None, b"from a stranger")
    assert refusals.wait_for("handoff", 1) >= 1
    push(endpoint, "a different secret entirely", b"from a guesser")
    assert refusals.wait_for("handoff", 2) >= 2
    # The holder of the secret is heard, and only it.
    push(endpoint, SECRET, b"from the cluster")
    assert pull.poll(30_000)
    assert pull.recv() == b"from the cluster"
    assert not pull.poll(200)


def test_kv_side_channel_needs_the_secret(monkeypatch):
    """Sender and receiver of one process share the installed auth; a stranger's frames on the
    sender's socket are refused and counted, and pages still move between holders."""
    refusals = Refusals()
    auth = ClusterAuth(SECRET, refusals)
    monkeypatch.setattr(cluster_auth, "_installed", auth)
    layout = make_layout("bf16")
    source = KVPool(layout, 4, "cpu")
    fill_pool(source, 3)
    sender = create_sender("zmq", source, "prefill-auth")
    receiver = create_receiver("zmq", KVPool(layout, 4, "cpu"), "decode-auth")
    try:
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(sender.endpoint)
        send_unless_refused(stranger, b"\x81\xa4type\xa4junk")
        assert refusals.wait_for("kv", 1) >= 1
        stranger.close()

        params = sender.publish("held", [2], 30)
        receiver.start_fetch("held", params, [1], timeout=20)
        results: list = []
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            sender.poll()
            results += receiver.poll()
            time.sleep(0.001)
        assert results and results[0].ok, results
        assert torch.equal(receiver.pool.page_bytes(1), source.page_bytes(2))
    finally:
        sender.close()
        receiver.close()
        auth.close()
