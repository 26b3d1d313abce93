"""The router's own overhead and throughput, with workers that answer at once.

    python -m benchmarks.router [--requests 4000] [--concurrency 32]

Starts ``python -m router`` as a subprocess, registers an in-process fake decode worker on its
control socket that answers every DecodeRequest/PrefillRequest with one finished TokenDelta, and
drives ``POST /v1/completions`` with a concurrent httpx client. Reports the client-side
requests/s and latency, and the router's own time per request from its
``pdserve_router_overhead_seconds`` histogram (arrival to dispatch, final token to response),
percentiles interpolated within buckets.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.messages import PROTOCOL_VERSION, decode, encode
from common.model.default_model import resolve_model_path
from common.protocol import (
    DecodeRequest,
    Heartbeat,
    PrefillRequest,
    RegisterWorker,
    TokenDelta,
    TokenSample,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InstantWorker(threading.Thread):
    """A decode worker that answers each request at once with one finished token."""

    def __init__(self, endpoint: str, model: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.model = model
        self.stop = threading.Event()
        self.registered = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"bench-d0")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.send(
            encode(
                RegisterWorker(
                    PROTOCOL_VERSION, "bench-d0", "decode", self.model, {"block_size": 16},
                    "zmq", 1 << 20, 1 << 16, "", "tcp://127.0.0.1:1",
                )
            )
        )  # fmt: skip
        last = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last > 0.5:
                sock.send(encode(Heartbeat("bench-d0", 0, 0, 0, 1 << 20, 0.0)))
                last = now
            if not sock.poll(100):
                continue
            while True:
                try:
                    msg = decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, (DecodeRequest, PrefillRequest)):
                    sock.send(
                        encode(
                            TokenDelta(msg.request_id, [TokenSample(42)], 0, "length", 4, 0, True)
                        )
                    )
                else:
                    self.registered.set()
        sock.close(0)
        ctx.term()


async def _drive(url: str, model: str, total: int, concurrency: int) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": "Hello, router!", "max_tokens": 1}
    latencies: list[float] = []
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

        async def one_client() -> None:
            for _ in counter:
                start = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def _histogram(metrics_text: str, stage: str) -> list[tuple[float, float]]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "pdserve_router_overhead_seconds":
            return sorted(
                (float(s.labels["le"]), s.value)
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels.get("stage") == stage
            )
    return []


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    total = buckets[-1][1]
    target = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= target:
            if bound == float("inf"):
                return lower_bound
            fraction = (target - lower_count) / max(count - lower_count, 1e-9)
            return lower_bound + fraction * (bound - lower_bound)
        lower_bound, lower_count = bound, count
    return lower_bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    model_path = resolve_model_path(None)
    port, control_port = _free_port(), _free_port()
    control = f"tcp://127.0.0.1:{control_port}"
    router = subprocess.Popen(
        [sys.executable, "-m", "router", "--port", str(port), "--control", control,
         "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    worker = InstantWorker(control, model_path.name)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or router.poll() is not None:
                raise RuntimeError("the router did not start")
            time.sleep(0.1)
        worker.start()
        while httpx.get(url + "/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake worker did not register")
            time.sleep(0.05)
        asyncio.run(_drive(url, model_path.name, min(500, args.requests), args.concurrency))
        baseline = httpx.get(url + "/metrics").text
        elapsed, latencies = asyncio.run(
            _drive(url, model_path.name, args.requests, args.concurrency)
        )
        after = httpx.get(url + "/metrics").text
    finally:
        worker.stop.set()
        router.terminate()
        router.wait(10)
    print(f"router benchmark: {args.requests} requests, {args.concurrency} concurrent clients")
    rate = args.requests / elapsed
    print(f"  throughput             {rate:8.0f} req/s (client and router share the CPUs)")
    lat = sorted(latencies)
    print(
        f"  client latency         p50 {statistics.median(lat) * 1e3:6.2f} ms   "
        f"p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:6.2f} ms"
    )
    for stage in ("dispatch", "respond"):
        before = dict(_histogram(baseline, stage))
        buckets = [(b, c - before.get(b, 0.0)) for b, c in _histogram(after, stage)]
        p50, p99 = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
        print(f"  router {stage:<15} p50 {p50 * 1e3:6.3f} ms   p99 {p99 * 1e3:6.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
