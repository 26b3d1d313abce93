"""Who may speak on pdserve's internal sockets: the holders of the cluster secret.

With a cluster secret set, every ZeroMQ socket between pdserve's processes (the router's control
socket, a decode worker's handoff socket, the KV side channel) runs CURVE: traffic is encrypted,
and a peer gets in only by proving it holds the secret. Both keypairs derive from the secret,
one for every socket that binds ("server"), one for every socket that connects ("client"); each
binding socket's context runs a ZAP handler that admits only the cluster's client key. A peer
without the secret fails the handshake inside libzmq, before any of its bytes reach pdserve,
and the failure is counted per socket (``pdserve_auth_failures_total``).

The secret comes from ``PDSERVE_CLUSTER_SECRET`` or a file named by ``--cluster-secret-file``
(``pdserve up`` makes one per cluster and hands it to its processes in the environment). Without
one the sockets run in the clear: a stranger that reaches them registers as a worker, reads
prompts and forges answers. On loopback that is allowed (with a warning at start-up); a process
whose internal sockets bind any other address refuses to start without a secret, unless it is
given ``--insecure-no-auth`` (and then warns that it runs open).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
INSECURE_FLAG = "--insecure-no-auth"
MIN_SECRET_CHARS = 16
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's two CURVE keypairs (Z85), derived from its secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKeys:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster secret must have at least {MIN_SECRET_CHARS} characters")

        def keypair(role: str) -> tuple[bytes, bytes]:
            # Any 32 bytes are a Curve25519 secret key; the public key follows from it.
            secret_key = z85.encode(hashlib.sha256(f"pdserve-{role}:{secret}".encode()).digest())
            return zmq.curve_public(secret_key), secret_key

        server_public, server_secret = keypair("server")
        client_public, client_secret = keypair("client")
        return cls(server_public, server_secret, client_public, client_secret)


def load_secret(path: str | None = None) -> str | None:
    """The cluster secret from ``path`` (its first line) or ``PDSERVE_CLUSTER_SECRET``; None
    when neither is set. Raises ``ValueError`` for an unreadable file or a short secret."""
    if path:
        try:
            secret = Path(path).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ValueError(f"cannot read the cluster secret from {path}: {exc}") from None
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        if not secret:
            return None
    ClusterKeys.from_secret(secret)  # checks the length
    return secret


def add_insecure_flag(parser: argparse.ArgumentParser) -> None:
    """``--insecure-no-auth``, read by ``secret_for_binding``."""
    parser.add_argument(
        INSECURE_FLAG,
        action="store_true",
        help="run without a cluster secret even where the internal sockets bind an address "
        "other than loopback (anyone who reaches them can join the cluster)",
    )


def secret_for_binding(path: str | None, binds: Iterable[str], insecure: bool) -> str | None:
    """``load_secret(path)``, checked against where this process's internal sockets bind
    (hosts or ZeroMQ endpoints). Without a secret, any address that is not loopback raises
    ``ValueError`` naming ``--cluster-secret-file``, unless ``insecure`` (then a warning)."""
    secret = load_secret(path)
    if secret is not None:
        return secret
    exposed = [bind for bind in binds if not is_loopback(bind)]
    if not exposed:
        return None
    if not insecure:
        raise ValueError(
            f"the internal sockets bind {', '.join(exposed)}, which is not loopback, and no "
            f"cluster secret is set: anyone who reaches them could register as a worker, read "
            f"prompts and forge answers. Give every process the same secret with "
            f"--cluster-secret-file (or {SECRET_ENV}), or pass {INSECURE_FLAG} to run open"
        )
    logger.warning(
        "%s: the internal sockets bind %s WITHOUT AUTHENTICATION OR ENCRYPTION; anyone who "
        "reaches them can join this cluster, read its prompts and forge its answers",
        INSECURE_FLAG,
        ", ".join(exposed),
    )
    return None


def is_loopback(bind: str) -> bool:
    """Whether a host, or a ZeroMQ endpoint (``tcp://HOST:PORT``, ``ipc://``, ``inproc://``),
    can be reached only from this machine. A name counts when every address it resolves to is
    loopback; one that does not resolve, a wildcard or an interface name does not."""
    transport, sep, rest = bind.partition("://")
    if sep and transport in ("ipc", "inproc"):
        return True
    host = rest if sep else bind
    if sep:
        host = host.rsplit(":", 1)[0]  # the port
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host or host == "*":
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


class ClusterAuth:
    """Secures a process's internal sockets with the cluster's keys (or leaves them in the
    clear without a secret). ``count_failure(socket_name)`` is called for every handshake a
    binding socket refuses."""

    def __init__(
        self, secret: str | None, count_failure: Callable[[str], None], quiet: bool = False
    ) -> None:
        self.keys = ClusterKeys.from_secret(secret) if secret else None
        self._count_failure = count_failure
        self._authenticators: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}
        self._watchers: list[_HandshakeWatcher] = []
        self._lock = threading.Lock()
        if self.keys is None and not quiet:
            logger.warning(
                "no cluster secret (%s or --cluster-secret-file): internal sockets are "
                "unauthenticated and unencrypted",
                SECRET_ENV,
            )

    def server(self, socket: zmq.Socket, name: str) -> None:
        """Make ``socket`` (before it binds) accept only peers holding the secret."""
        if self.keys is None:
            return
        self._authenticator(socket.context).configure_curve_callback(name, _ClientKey(self.keys))
        socket.zap_domain = name.encode()
        socket.curve_server = True
        socket.curve_secretkey = self.keys.server_secret
        socket.curve_publickey = self.keys.server_public
        with self._lock:
            self._watchers.append(_HandshakeWatcher(socket, name, self._count_failure))

    def client(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it connects) prove the secret to the socket it joins."""
        if self.keys is None:
            return
        socket.curve_serverkey = self.keys.server_public
        socket.curve_secretkey = self.keys.client_secret
        socket.curve_publickey = self.keys.client_public

    def close(self) -> None:
        with self._lock:
            watchers, self._watchers = self._watchers, []
            authenticators, self._authenticators = self._authenticators, {}
        for watcher in watchers:
            watcher.stop()
        for authenticator in authenticators.values():
            authenticator.stop()

    def _authenticator(self, context: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator:
        # One ZAP handler per context: libzmq asks the one bound at inproc://zeromq.zap.01.
        with self._lock:
            authenticator = self._authenticators.get(id(context))
            if authenticator is None:
                authenticator = zmq.auth.thread.ThreadAuthenticator(context, log=logger)
                authenticator.start()
                self._authenticators[id(context)] = authenticator
            return authenticator


_installed: ClusterAuth | None = None


def install(auth: ClusterAuth) -> None:
    """Make ``auth`` the process's: sockets made without one at hand (the KV side channel) use
    it. A worker installs its own at start-up."""
    global _installed
    _installed = auth


def installed() -> ClusterAuth:
    """The process's ``ClusterAuth``; without one installed, sockets stay in the clear."""
    global _installed
    if _installed is None:
        _installed = ClusterAuth(None, lambda name: None, quiet=True)
    return _installed


class _ClientKey:
    """ZAP's CURVE check: the client's public key must be the cluster's."""

    def __init__(self, keys: ClusterKeys) -> None:
        self._expected = keys.client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self._expected


class _HandshakeWatcher:
    """Counts the handshakes a binding socket refuses (from its monitor), in a thread."""

    def __init__(self, socket: zmq.Socket, name: str, count: Callable[[str], None]) -> None:
        self._monitor = socket.get_monitor_socket(_HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED)
        self._socket = socket
        self._name = name
        self._count = count
        self._thread = threading.Thread(target=self._run, name=f"auth-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event["event"] & _HANDSHAKE_FAILURES:
                    logger.warning(
                        "%s socket refused a peer that did not prove the cluster secret",
                        self._name,
                    )
                    self._count(self._name)
        except zmq.ZMQError:
            return  # the context is gone
        finally:
            self._monitor.close(linger=0)

    def stop(self) -> None:
        if not self._socket.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
        self._thread.join(timeout=5)
