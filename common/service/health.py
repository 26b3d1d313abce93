"""A worker's HTTP port: ``/metrics`` for Prometheus, ``/health`` and ``/ready`` for probes.

Workers have no HTTP API; the router reaches them over ZeroMQ. A supervisor (Kubernetes'
probes, a load balancer's checks) asks this port instead, served from a daemon thread:

- ``/health`` (liveness): 200 unless the main loop has not turned for ``STALL_S`` (a step that
  never ends, a deadlock); while the worker starts (model load, warm-up) it is 200 too.
- ``/ready`` (readiness): 200 once the worker is registered with the router and its loop turns,
  503 before that and while it drains (``common/service/drain.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

# A turn of the main loop is one engine step at most: on a CPU a 2048-token prefill step takes
# seconds, a first Triton compile tens of them. A loop that has not turned for this long is
# stuck, and a restart is the way out.
STALL_S = 120.0


class Probes:
    """What the probes answer. The main loop calls ``turned`` once a turn; the HTTP thread
    reads (floats and bools: each read sees one whole value)."""

    def __init__(self, stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic):
        self.stall_s = stall_s
        self.clock = clock
        self.last_turn: float | None = None  # None until registered and looping
        self.draining = False

    def turned(self, draining: bool) -> None:
        self.last_turn = self.clock()
        self.draining = draining

    def live(self) -> tuple[bool, str]:
        last = self.last_turn
        if last is None:
            return True, "starting"
        idle = self.clock() - last
        if idle > self.stall_s:
            return False, f"the main loop has not turned for {idle:.0f} s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if self.last_turn is None:
            return False, "not registered with the router yet"
        if self.draining:
            return False, "draining"
        return self.live()


def serve_worker_http(host: str, port: int, probes: Probes) -> str:
    """Serve /metrics, /health and /ready on ``host:port`` (0: any free port) in a daemon
    thread; returns the metrics URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path in ("/health", "/ready"):
                ok, why = probes.live() if path == "/health" else probes.ready()
                self._answer(200 if ok else 503, why.encode() + b"\n", "text/plain")
            else:
                self._answer(404, b"not found: try /metrics, /health or /ready\n", "text/plain")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            pass  # a scrape every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-http", daemon=True).start()
    return f"http://{host}:{server.server_address[1]}/metrics"
