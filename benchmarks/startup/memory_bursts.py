"""Resident memory of every pdserve service across bursts of concurrent streams.

Starts `pdserve up` (default model unless told otherwise), then sends BURSTS bursts of STREAMS
concurrent streamed completions, each read to its end, and prints each service's resident
memory when idle before the first burst and after each one. A service whose idle memory keeps
growing once the second burst has passed (caches and allocator arenas are warm by then) leaks.
A line per burst (``--streams 16 --bursts 2 --max-tokens 4``)::

    burst 2: 16/16 streams finished in 4 s; idle MiB: router 144, prefill_worker 3471,
    decode_worker 3511

(wrapped here).

    python -m benchmarks.startup.memory_bursts [--streams 500] [--bursts 3] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.harness import pdserve_up
from common.model.default_model import resolve_model_path

PORT = 8300


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def services(launcher: int) -> dict[str, int]:
    """The launcher's children by the module they run (router, prefill_worker, decode_worker)."""
    found = {}
    pids = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    for pid in map(int, pids.stdout.split()):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        module = argv[argv.index(b"-m") + 1].decode() if b"-m" in argv else str(pid)
        found[module] = pid
    return found


async def burst(base: str, model: str, streams: int, max_tokens: int) -> int:
    """``streams`` streamed completions at once; returns how many finished with [DONE]."""
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def one(i: int) -> bool:
            body = {"model": model, "prompt": f"item {i} " * (5 + i % 40),
                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
            async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return False
                last = ""
                async for line in response.aiter_lines():
                    last = line or last
            return last == "data: [DONE]"

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    with pdserve_up(model, port=PORT) as cluster:
        base = cluster.base_url
        pids = services(cluster.process.pid)
        print("idle MiB before any burst: " + ", ".join(
            f"{name} {resident_mib(pid):.0f}" for name, pid in pids.items()))  # fmt: skip
        for index in range(args.bursts):
            started = time.monotonic()
            done = asyncio.run(burst(base, model.name, args.streams, args.max_tokens))
            time.sleep(2)  # let the last frees land
            seconds = time.monotonic() - started
            figures = ", ".join(f"{name} {resident_mib(pid):.0f}" for name, pid in pids.items())
            print(
                f"burst {index + 1}: {done}/{args.streams} streams finished in {seconds:.0f} s; "
                f"idle MiB: {figures}",
                flush=True,
            )


if __name__ == "__main__":
    main()
