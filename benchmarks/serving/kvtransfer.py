"""KV-page transfer between two processes on one host: ZeroMQ and NIXL against memcpy.

A sender process (like a prefill worker) publishes pages of a SmolLM2-shaped pool; this process
(like a decode worker) fetches them into other pages of its own pool. Prints:

- the transports each backend used (side channel, and pages);
- GB/s moving 1, 16 and 256 MB of pages (scattered page ids, as in a pool that has been in use),
  beside a torch ``copy_`` of the same number of bytes, with the ratio to it;
- the time until a receiver holds all 256 pages of a 4k-token prompt, with and without the
  first-contact handshake, and with its pages in a row on both sides (a pool not yet
  fragmented);
- CPU the sender and receiver processes spend per GB of the largest size: how many of the
  host's cores a transfer keeps busy, which is what bounds it on a small host;
- CPU used by an idle sender + receiver pair with NIXL initialised, per process and its busiest
  thread, beside a NIXL agent left with its default progress thread.

Every figure is the median of ``--repeats`` runs. A row per size, e.g. on 2 shared cores
(``--repeats 2 --backends zmq --sizes-mb 1 16``)::

        size  pages  memcpy GB/s    zmq GB/s  vs memcpy
        16MB     46        13.98        1.75       12%

Usage::

    python -m benchmarks.serving.kvtransfer [--repeats 5] [--backends zmq nixl]
        [--sizes-mb 1 16 256]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import random
import resource
import socket
import statistics
import time
from pathlib import Path

import torch
import zmq

from common.engine.kv_pool import KVPool, kv_layout
from common.messages import from_wire, to_wire
from kvtransfer import TransferParams, create_receiver, create_sender

# SmolLM2-135M: 30 layers, 3 KV heads of 64, pages of 16 tokens in bf16: 368,640 bytes a page.
LAYOUT = kv_layout(torch.bfloat16, page_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
PROMPT_PAGES = 4096 // LAYOUT.page_size
SEED = 1234
# How long an idle worker loop waits on its sockets before polling again.
IDLE_WAIT_MS = 10
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def fill(pool: KVPool) -> None:
    generator = torch.Generator().manual_seed(SEED)
    raw = pool.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))


def sender_process(backend: str, pool_pages: int, control_endpoint: str) -> None:
    """A prefill worker's loop, reduced to serving KV pages."""
    torch.set_num_threads(1)
    pool = KVPool(LAYOUT, pool_pages, "cpu")
    fill(pool)
    sender = create_sender(backend, pool, engine_id=f"bench-prefill-{backend}")
    control = zmq.Context.instance().socket(zmq.PAIR)
    control.connect(control_endpoint)
    control.send_json({"endpoint": sender.endpoint, "pid": os.getpid()})
    poller = zmq.Poller()
    for sock in [control, *sender.poll_sockets()]:
        poller.register(sock, zmq.POLLIN)
    while True:
        events = dict(poller.poll(IDLE_WAIT_MS))
        sender.poll()
        if control not in events:
            continue
        command = control.recv_json()
        if command["cmd"] == "stop":
            break
        params = sender.publish(command["request_id"], command["page_ids"], command["lease"])
        control.send_json(to_wire(params))
    sender.close()
    control.close()


class SenderHandle:
    def __init__(self, backend: str, pool_pages: int) -> None:
        self.control = zmq.Context.instance().socket(zmq.PAIR)
        port = self.control.bind_to_random_port("tcp://127.0.0.1")
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=sender_process, args=(backend, pool_pages, f"tcp://127.0.0.1:{port}")
        )
        self.process.start()
        if not self.control.poll(120_000):
            raise RuntimeError("the sender process did not start")
        hello = self.control.recv_json()
        self.pid = hello["pid"]

    def publish(self, request_id: str, page_ids: list[int]) -> TransferParams:
        self.control.send_json(
            {"cmd": "publish", "request_id": request_id, "page_ids": page_ids, "lease": 120}
        )
        if not self.control.poll(30_000):
            raise RuntimeError("the sender process stopped answering")
        return from_wire(TransferParams, self.control.recv_json())

    def stop(self) -> None:
        self.control.send_json({"cmd": "stop"})
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        self.control.close()


def wait_on(sockets: list, timeout_ms: int) -> None:
    """Block until one of ``sockets`` has traffic, or ``timeout_ms``: an idle worker's wait."""
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    poller.poll(timeout_ms)


def fetch(receiver, request_id: str, params: TransferParams, dst: list[int]) -> float:
    """Seconds from start_fetch until the pages are in place.

    Between polls the receiver waits on its sockets (at most 1 ms), as an idle decode worker
    would: spinning on poll() would take a core from the kernel and ZMQ threads moving the data.
    """
    started = time.perf_counter()
    receiver.start_fetch(request_id, params, dst, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for result in receiver.poll():
            if not result.ok:
                raise RuntimeError(f"fetch {request_id} failed: {result.error}")
            return time.perf_counter() - started
        wait_on(receiver.poll_sockets(), timeout_ms=1)
    raise RuntimeError(f"fetch {request_id} did not finish")


def pages_for(megabytes: float) -> int:
    return max(1, round(megabytes * 2**20 / LAYOUT.page_nbytes))


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not part of a copy's cost
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cpu_seconds(pid: int) -> tuple[float, dict[str, float]]:
    """CPU time of a process, and of each of its threads by name (from /proc)."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:
            continue
        threads[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, threads


def own_cpu_seconds() -> float:
    """CPU time of this process, all its threads (ZeroMQ's and UCX's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def idle_cpu(pids: list[int], receiver, seconds: float) -> list[tuple[float, float]]:
    """(process CPU %, busiest thread CPU %) of each pid while this process idles like a worker."""
    before = [cpu_seconds(pid) for pid in pids]
    poller_deadline = time.monotonic() + seconds
    started = time.monotonic()
    while time.monotonic() < poller_deadline:
        wait_on(receiver.poll_sockets(), IDLE_WAIT_MS)
        receiver.poll()
    elapsed = time.monotonic() - started
    usage = []
    for pid, (total0, threads0) in zip(pids, before, strict=True):
        total1, threads1 = cpu_seconds(pid)
        busiest = max((threads1[name] - threads0.get(name, 0.0) for name in threads1), default=0.0)
        usage.append((100 * (total1 - total0) / elapsed, 100 * busiest / elapsed))
    return usage


def default_agent_process(ready) -> None:
    from nixl._api import nixl_agent

    agent = nixl_agent("bench-default-config")  # progress thread on, as NIXL ships it
    ready.set()
    time.sleep(3600)
    del agent


def default_agent_idle_cpu(seconds: float) -> float:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=default_agent_process, args=(ready,), daemon=True)
    process.start()
    try:
        ready.wait(120)
        time.sleep(0.5)
        total0, _ = cpu_seconds(process.pid)
        time.sleep(seconds)
        total1, _ = cpu_seconds(process.pid)
        return 100 * (total1 - total0) / seconds
    finally:
        process.kill()
        process.join()


def ceiling_peer(kind: str, nbytes: int, conn) -> None:
    """The far end of a bare-transport measurement: serves ``nbytes`` over TCP, or exposes them
    to process_vm_readv."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    if kind == "cma":
        conn.send(data.ctypes.data)
        conn.recv()
        return
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(server.getsockname()[1])
        client, _ = server.accept()
        with client:
            while client.recv(1):
                client.sendall(data)


def transport_ceiling(kind: str, nbytes: int, repeats: int) -> float:
    """Seconds to move ``nbytes`` between two processes over the bare transport under a backend:
    a TCP loopback socket (ZeroMQ), or process_vm_readv in page-sized pieces (UCX's CMA)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=ceiling_peer, args=(kind, nbytes, child), daemon=True)
    process.start()
    dst = torch.ones(nbytes, dtype=torch.uint8).numpy()
    times = []
    try:
        if kind == "cma":
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            remote = parent.recv()
            iovecs = (ctypes.c_size_t * 4)()  # local (base, len), then remote (base, len)
            for _ in range(repeats + 1):
                started = time.perf_counter()
                for offset in range(0, nbytes, LAYOUT.page_nbytes):
                    length = min(LAYOUT.page_nbytes, nbytes - offset)
                    iovecs[:] = [dst.ctypes.data + offset, length, remote + offset, length]
                    local, far = ctypes.byref(iovecs), ctypes.byref(iovecs, 16)
                    if libc.process_vm_readv(process.pid, local, 1, far, 1, 0) != length:
                        raise OSError(ctypes.get_errno(), "process_vm_readv failed")
                times.append(time.perf_counter() - started)
            parent.send("done")
        else:
            view = memoryview(dst)
            with socket.create_connection(("127.0.0.1", parent.recv())) as conn:
                for _ in range(repeats + 1):
                    started = time.perf_counter()
                    conn.sendall(b"x")
                    received = 0
                    while received < nbytes:
                        received += conn.recv_into(view[received:])
                    times.append(time.perf_counter() - started)
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    return statistics.median(times[1:])  # the first run pays for first touches


def transports(backend: str, params: TransferParams) -> str:
    side_channel = params.endpoint.split("://")[0]
    if backend == "nixl":
        tls = os.environ.get("UCX_TLS", "unset: UCX's choice, CMA between processes of one host")
        return f"side channel over {side_channel}; pages READ by UCX (UCX_TLS {tls})"
    return f"side channel and page frames over {side_channel}"


def run_backend(backend: str, sizes_mb: list[float], repeats: int, pool_pages: int) -> dict:
    rng = random.Random(SEED)
    sender = SenderHandle(backend, pool_pages)
    expected = KVPool(LAYOUT, pool_pages, "cpu")
    fill(expected)
    pool = KVPool(LAYOUT, pool_pages, "cpu")
    pool.data.view(torch.uint8).fill_(1)  # touch the destination pool once, as a live one is
    receiver = create_receiver(backend, pool, engine_id=f"bench-decode-{backend}")
    out: dict = {"throughput": {}, "cpu_per_gb": {}}
    counter = 0

    def one(num_pages: int, verify: bool = False, in_a_row: bool = False) -> float:
        nonlocal counter
        counter += 1
        if in_a_row:
            src_first, dst_first = (rng.randrange(pool_pages - num_pages + 1) for _ in range(2))
            src = list(range(src_first, src_first + num_pages))
            dst = list(range(dst_first, dst_first + num_pages))
        else:
            src = rng.sample(range(pool_pages), num_pages)
            dst = rng.sample(range(pool_pages), num_pages)
        params = sender.publish(f"r{counter}", src)
        out["transports"] = transports(backend, params)
        seconds = fetch(receiver, f"r{counter}", params, dst)
        if verify:
            # Compared as bytes: random bits include NaNs, which never equal themselves.
            got, want = pool.data[dst].view(torch.uint8), expected.data[src].view(torch.uint8)
            assert torch.equal(got, want), "pages differ"
        return seconds

    try:
        out["cold_prompt_s"] = one(PROMPT_PAGES, verify=True)  # includes the handshake
        out["warm_prompt_s"] = statistics.median(one(PROMPT_PAGES) for _ in range(repeats))
        one(PROMPT_PAGES, verify=True, in_a_row=True)
        out["row_prompt_s"] = statistics.median(
            one(PROMPT_PAGES, in_a_row=True) for _ in range(repeats)
        )
        for megabytes in sizes_mb:
            num_pages = pages_for(megabytes)
            one(num_pages, verify=True)
            sender_cpu0, receiver_cpu0 = cpu_seconds(sender.pid)[0], own_cpu_seconds()
            times = [one(num_pages) for _ in range(repeats)]
            # Once the receiver holds the pages the sender has nothing left to do but release.
            sender_cpu = cpu_seconds(sender.pid)[0] - sender_cpu0
            receiver_cpu = own_cpu_seconds() - receiver_cpu0
            moved = num_pages * LAYOUT.page_nbytes
            out["throughput"][megabytes] = (moved, statistics.median(times))
            gigabytes = moved * repeats / 1e9
            out["cpu_per_gb"][megabytes] = (
                sender_cpu / gigabytes,
                receiver_cpu / gigabytes,
                sum(times) / gigabytes,
            )
        if backend == "nixl":
            samples = [idle_cpu([sender.pid, os.getpid()], receiver, 2.0) for _ in range(3)]
            out["idle"] = [
                tuple(statistics.median(s[i][j] for s in samples) for j in range(2))
                for i in range(2)
            ]
    finally:
        receiver.close()
        sender.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["zmq", "nixl"])
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 16, 256])
    args = parser.parse_args()
    pool_pages = max(pages_for(max(args.sizes_mb)), PROMPT_PAGES) + 64

    print(
        f"page = {LAYOUT.page_nbytes:,} bytes (SmolLM2-135M, bf16, 16 tokens); pool = "
        f"{pool_pages} pages; median of {args.repeats}; torch threads = {torch.get_num_threads()}"
    )
    results = {
        backend: run_backend(backend, args.sizes_mb, args.repeats, pool_pages)
        for backend in args.backends
    }
    print("\ntransports:")
    for backend in args.backends:
        print(f"  {backend:>8}: {results[backend]['transports']}")
    memcpy = {
        mb: memcpy_seconds(pages_for(mb) * LAYOUT.page_nbytes, args.repeats) for mb in args.sizes_mb
    }

    print()
    header = f"{'size':>8} {'pages':>6} {'memcpy GB/s':>12}"
    for backend in args.backends:
        header += f" {backend + ' GB/s':>11} {'vs memcpy':>10}"
    print(header)
    for mb in args.sizes_mb:
        nbytes = pages_for(mb) * LAYOUT.page_nbytes
        copy_rate = nbytes / memcpy[mb] / 1e9
        row = f"{mb:>6g}MB {pages_for(mb):>6} {copy_rate:>12.2f}"
        for backend in args.backends:
            moved, seconds = results[backend]["throughput"][mb]
            rate = moved / seconds / 1e9
            row += f" {rate:>11.2f} {rate / copy_rate:>9.0%}"
        print(row)

    biggest = max(args.sizes_mb)
    print(f"\nCPU per GB moved ({biggest:g}MB transfers), beside the wall time per GB:")
    for backend in args.backends:
        sender_cpu, receiver_cpu, wall = results[backend]["cpu_per_gb"][biggest]
        print(
            f"  {backend:>8}: sender {1e3 * sender_cpu:5.0f} ms, "
            f"receiver {1e3 * receiver_cpu:5.0f} ms, wall {1e3 * wall:5.0f} ms "
            f"-> {(sender_cpu + receiver_cpu) / wall:.1f} cores busy"
        )
    nbytes = pages_for(biggest) * LAYOUT.page_nbytes
    copy_rate = nbytes / memcpy[biggest] / 1e9
    print(f"\nbare transports between two processes, {biggest:g}MB (each backend's ceiling):")
    for name, kind in [
        ("TCP loopback socket (under ZeroMQ)", "tcp"),
        ("process_vm_readv, page by page (under NIXL/UCX CMA)", "cma"),
    ]:
        rate = nbytes / transport_ceiling(kind, nbytes, args.repeats) / 1e9
        print(f"  {name:<52} {rate:6.2f} GB/s {rate / copy_rate:5.0%} of memcpy")

    print(
        f"\n4k-token prompt ({PROMPT_PAGES} pages, "
        f"{PROMPT_PAGES * LAYOUT.page_nbytes / 2**20:.0f} MiB): start_fetch -> all pages held"
    )
    for backend in args.backends:
        r = results[backend]
        print(
            f"  {backend:>8}: {1e3 * r['warm_prompt_s']:7.1f} ms   "
            f"(first contact, with handshake: {1e3 * r['cold_prompt_s']:.1f} ms; "
            f"pages in a row: {1e3 * r['row_prompt_s']:.1f} ms)"
        )

    if "nixl" in results:
        (sender_cpu, sender_thread), (receiver_cpu, receiver_thread) = results["nixl"]["idle"]
        print(
            f"\nidle CPU, NIXL initialised and connected, loops waking every {IDLE_WAIT_MS} ms "
            "(2 s windows):"
        )
        print(
            f"  sender process   {sender_cpu:5.1f}% of a core (busiest thread {sender_thread:.1f}%)"
        )
        print(
            f"  receiver process {receiver_cpu:5.1f}% of a core "
            f"(busiest thread {receiver_thread:.1f}%)"
        )
        print(
            f"  for comparison, one NIXL agent with its default progress thread: "
            f"{default_agent_idle_cpu(2.0):.0f}%"
        )


if __name__ == "__main__":
    main()
