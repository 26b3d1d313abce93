"""The router's own overhead and throughput, with a worker that answers at once.

    python -m benchmarks.serving.router [--duration 10] [--concurrency 32]
        [--client auto|wrk|python] [--repeats 1] [--profile FILE]

Starts ``python -m router`` as a subprocess and registers a fake decode worker (a thread of this
process) on its control socket that answers every DecodeRequest/PrefillRequest at once with one
finished TokenDelta. Load comes from a separate process: ``wrk`` with a Lua script when it is on
the PATH, otherwise this module's own HTTP/1.1 keep-alive client in two processes. Each request is
``POST /v1/completions`` with a short text prompt and ``max_tokens=1``, so every request is
tokenized, routed, sent over ZeroMQ, answered, detokenized and returned.

Two phases run one after the other against the same router:

- **latency**: one client, one request at a time. Its client latency p50 is the router's added
  latency end to end (HTTP parse to response written, plus two loopback round trips and the fake
  worker's turn-around, which are not the router's).
- **throughput**: ``--concurrency`` clients on keep-alive connections. Requests/s is what the
  router sustains on a CPU it shares with the client and the fake worker; client latency here is
  mostly queueing (concurrency / throughput).

For each phase it prints requests/s, client latency p50/p99, the router's internal time per
request from its ``pdserve_router_overhead_seconds`` histogram (arrival in the handler to
dispatch, final token to response body; percentiles interpolated within buckets), and the
router's CPU time per request (process, and its event-loop thread alone) from ``/proc``, e.g.
the throughput phase on 2 shared cores (``--duration 2 --concurrency 4``)::

      throughput phase: 4 client(s), 2985 requests in 2.0 s
        requests/s                       1491
        router added (sum)      p50   0.644 ms   p99   2.481 ms
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import free_port_pair
from common.kv_layout import KVLayout
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

PATH = "/v1/completions"
PROMPT = "Hello, router!"
STAGES = ("dispatch", "respond")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Requests one Python client connection may send in a phase, whatever the duration.
MAX_REQUESTS_PER_CONNECTION = 1_000_000

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("PDSERVE_BENCH_BODY")
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "PDSERVE_RESULT %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


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
                    protocol_version=PROTOCOL_VERSION,
                    worker_id="bench-d0",
                    incarnation="bench",
                    role="decode",
                    model=self.model,
                    kv_layout=KVLayout("bfloat16", 16, 1, 1, 64),
                    kv_transfer="zmq",
                    num_pages=1 << 20,
                    max_model_len=1 << 16,
                    metrics_url="",
                    handoff_endpoint="tcp://127.0.0.1:1",
                )
            )
        )
        last = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last > 0.5:
                sock.send(encode(Heartbeat("bench-d0", 0, 0, 0, 1 << 20, 0.0)))
                last = now
            if not sock.poll(100):
                continue
            for _ in range(1024):  # bounded: heartbeats go out between batches
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


# -- the router process ------------------------------------------------------------------------


class RouterProcess:
    """``python -m router`` in a subprocess, optionally under cProfile."""

    def __init__(self, port: int, control: str, profile: str | None):
        command = [sys.executable]
        if profile:
            command += ["-m", "cProfile", "-o", profile]
        command += ["-m", "router", "--port", str(port), "--control", control]
        command += ["--log-level", "warning"]
        self.profile = profile
        self.proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def cpu_seconds(self) -> tuple[float, float]:
        """(whole process, event-loop thread) user + system CPU seconds so far."""
        return self._stat(f"/proc/{self.proc.pid}/stat"), self._stat(
            f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat"
        )

    @staticmethod
    def _stat(path: str) -> float:
        try:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def stop(self) -> None:
        if self.proc.poll() is None:
            # uvicorn shuts down on SIGINT too, and cProfile writes its file on the way out.
            self.proc.send_signal(signal.SIGINT if self.profile else signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# -- load generators -----------------------------------------------------------------------------


@dataclass
class LoadResult:
    requests: int
    seconds: float
    p50: float  # client latency, seconds
    p99: float


def _request_bytes(port: int, body: bytes) -> bytes:
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connection(port: int, request: bytes, deadline: float, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(MAX_REQUESTS_PER_CONNECTION):
            if time.perf_counter() >= deadline:
                break
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is None:
                raise RuntimeError("the response has no Content-Length")
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
    finally:
        writer.close()


def _client_process(port: int, body: bytes, connections: int, seconds: float, out, go) -> None:
    """One client process: ``connections`` keep-alive connections, each one request at a time."""
    latencies: list[float] = []
    request = _request_bytes(port, body)

    async def drive() -> float:
        start = time.perf_counter()
        deadline = start + seconds
        await asyncio.gather(
            *(_connection(port, request, deadline, latencies) for _ in range(connections))
        )
        return time.perf_counter() - start

    out.send("ready")
    if not go.wait(60):
        return
    elapsed = asyncio.run(drive())
    out.send((elapsed, latencies))
    out.close()


def _python_load(port: int, body: bytes, concurrency: int, seconds: float) -> LoadResult:
    processes = min(concurrency, 2)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    running = []
    try:
        for share in shares:
            receiver, sender = ctx.Pipe(duplex=False)
            args = (port, body, share, seconds, sender, go)
            proc = ctx.Process(target=_client_process, args=args, daemon=True)
            proc.start()
            running.append((proc, receiver))
        for _, receiver in running:  # all started before any sends: one shared window
            if not receiver.poll(60) or receiver.recv() != "ready":
                raise RuntimeError("a client process did not start")
        go.set()
        elapsed = 0.0
        latencies: list[float] = []
        for _, receiver in running:
            if not receiver.poll(seconds + 60):
                raise RuntimeError("a client process did not report")
            seconds_taken, lat = receiver.recv()
            elapsed = max(elapsed, seconds_taken)
            latencies += lat
    finally:
        for proc, _ in running:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    latencies.sort()
    return LoadResult(
        len(latencies), elapsed, _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    )


def _wrk_load(port: int, body: bytes, concurrency: int, seconds: float, script: str) -> LoadResult:
    threads = min(concurrency, 2)
    command = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(round(seconds), 1)}s"]
    command += ["--timeout", "10s", "-s", script, f"http://127.0.0.1:{port}{PATH}"]
    done = subprocess.run(
        command,
        env={**os.environ, "PDSERVE_BENCH_BODY": body.decode()},
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PDSERVE_RESULT")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-500:]}{done.stderr}")
    requests, micros, errors, non_2xx, p50, p99 = (int(v) for v in lines[0].split()[1:])
    if errors or non_2xx:
        raise RuntimeError(f"wrk saw {errors} socket errors and {non_2xx} non-2xx answers")
    return LoadResult(requests, micros / 1e6, p50 / 1e6, p99 / 1e6)


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# -- the router's histogram ----------------------------------------------------------------------


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
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    target = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= target:
            if bound == float("inf"):
                return lower_bound
            fraction = (target - lower_count) / max(count - lower_count, 1e-9)
            return lower_bound + fraction * (bound - lower_bound)
        lower_bound, lower_count = bound, count
    return lower_bound


def _stage_quantiles(before: str, after: str) -> dict[str, tuple[float, float]]:
    out = {}
    for stage in STAGES:
        base = dict(_histogram(before, stage))
        buckets = [(b, c - base.get(b, 0.0)) for b, c in _histogram(after, stage)]
        out[stage] = (_quantile(buckets, 0.5), _quantile(buckets, 0.99))
    return out


# -- one phase ------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    concurrency: int
    load: LoadResult
    stages: dict[str, tuple[float, float]]
    cpu_ms: float  # router process CPU per request
    loop_cpu_ms: float  # the router's event-loop thread alone

    @property
    def rate(self) -> float:
        return self.load.requests / self.load.seconds


def _phase(name, router, url, run_load, concurrency: int, seconds: float) -> Phase:
    before = httpx.get(url + "/metrics", timeout=10).text
    cpu0, loop0 = router.cpu_seconds()
    load = run_load(concurrency, seconds)
    cpu1, loop1 = router.cpu_seconds()
    after = httpx.get(url + "/metrics", timeout=10).text
    n = max(load.requests, 1)
    return Phase(
        name,
        concurrency,
        load,
        _stage_quantiles(before, after),
        (cpu1 - cpu0) / n * 1e3,
        (loop1 - loop0) / n * 1e3,
    )


def _print_phase(p: Phase) -> None:
    print(
        f"  {p.name} phase: {p.concurrency} client(s), {p.load.requests} requests in "
        f"{p.load.seconds:.1f} s"
    )
    print(f"    requests/s                  {p.rate:9.0f}")
    print(
        f"    client latency          p50 {p.load.p50 * 1e3:7.3f} ms   "
        f"p99 {p.load.p99 * 1e3:7.3f} ms"
    )
    total50 = sum(p.stages[s][0] for s in STAGES)
    total99 = sum(p.stages[s][1] for s in STAGES)
    for stage in STAGES:
        p50, p99 = p.stages[stage]
        print(f"    router {stage:<8}         p50 {p50 * 1e3:7.3f} ms   p99 {p99 * 1e3:7.3f} ms")
    print(f"    router added (sum)      p50 {total50 * 1e3:7.3f} ms   p99 {total99 * 1e3:7.3f} ms")
    print(
        f"    router CPU per request      {p.cpu_ms:7.3f} ms  (event-loop thread "
        f"{p.loop_cpu_ms:.3f} ms)"
    )


def _median_phase(phases: list[Phase]) -> Phase:
    """The run with the median requests/s (its figures stay consistent with one another)."""
    return sorted(phases, key=lambda p: p.rate)[len(phases) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.router")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput-phase clients")
    parser.add_argument("--client", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each phase (median)")
    parser.add_argument("--profile", default=None, help="run the router under cProfile into FILE")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or args.repeats < 1:
        parser.error("--duration must be > 0, --concurrency and --repeats >= 1")
    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "python"
    if client == "wrk" and not shutil.which("wrk"):
        parser.error("wrk is not on the PATH")

    model_path = resolve_model_path(None)
    body = json.dumps({"model": model_path.name, "prompt": PROMPT, "max_tokens": 1}).encode()
    port = free_port_pair()
    control = f"tcp://127.0.0.1:{port + 1}"
    url = f"http://127.0.0.1:{port}"
    router = RouterProcess(port, control, args.profile)
    worker = InstantWorker(control, model_path.name)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT)

    def run_load(concurrency: int, seconds: float) -> LoadResult:
        if client == "wrk":
            return _wrk_load(port, body, concurrency, seconds, script.name)
        return _python_load(port, body, concurrency, seconds)

    phases: dict[str, list[Phase]] = {"latency": [], "throughput": []}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or router.proc.poll() is not None:
                raise RuntimeError("the router did not start")
            time.sleep(0.1)
        worker.start()
        while httpx.get(url + "/health", timeout=1).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake worker did not register")
            time.sleep(0.05)
        run_load(args.concurrency, min(2.0, args.duration))  # warm-up
        for _ in range(args.repeats):
            phases["latency"].append(_phase("latency", router, url, run_load, 1, args.duration))
            phases["throughput"].append(
                _phase("throughput", router, url, run_load, args.concurrency, args.duration)
            )
    finally:
        worker.stop.set()
        router.stop()
        os.unlink(script.name)

    load_name = "wrk (its own process)" if client == "wrk" else "Python HTTP client (2 processes)"
    print(
        "router benchmark: POST /v1/completions, max_tokens=1, fake decode worker answering at once"
    )
    print(
        f"  load generator  {load_name}; {os.cpu_count()} CPUs shared by client, router and "
        "fake worker"
    )
    print(
        "  transport       HTTP/1.1 keep-alive over TCP 127.0.0.1; control: ZeroMQ "
        f"ROUTER/DEALER over {control}"
    )
    if args.repeats > 1:
        print(f"  each phase: the run with the median requests/s of {args.repeats}")
    if args.profile:
        print(f"  the router ran under cProfile (figures inflated); profile in {args.profile}")
    for name in ("latency", "throughput"):
        _print_phase(_median_phase(phases[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
