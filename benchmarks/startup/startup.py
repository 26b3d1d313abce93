"""How long `pdserve up` takes to serve: the seconds from its start until it says it is up (the
router and every worker registered) and until its first completion comes back.

A pool scales out by starting workers, so a worker's start-up is how long new capacity takes to
arrive, and every test cluster pays it too. Each round starts `pdserve up` afresh (flags after
the benchmark's own are passed to it), sends one short greedy completion, and stops it; the
figures are each round's and the best and median over the rounds, the last line (SmolLM2, 2
CPU cores, one round)::

    up: best 16.53 s, median 16.53 s; first completion: best 16.70 s, median 16.70 s

    python -m benchmarks.startup.startup [--model FOLDER] [--rounds 3] [pdserve up flags]

The model is `pdserve up`'s default (SmolLM2) unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from benchmarks.harness import start_cluster
from common.model.default_model import resolve_model_path


def one_round(model: Path, port: int, flags: list[str]) -> tuple[float, float]:
    """(seconds until `pdserve up` says it is up, seconds until its first completion)."""
    start = time.monotonic()
    cluster = start_cluster(model, *flags, port=port)
    try:
        cluster.wait_until_up()
        up = time.monotonic() - start
        body = {"model": model.name, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{cluster.base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            json.loads(response.read())
        return up, time.monotonic() - start
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18400)
    args, up_flags = parser.parse_known_args()
    model = resolve_model_path(args.model)
    ups, firsts = [], []
    for index in range(args.rounds):
        up, first = one_round(model, args.port, up_flags)
        ups.append(up)
        firsts.append(first)
        print(f"round {index + 1}: up {up:.2f} s, first completion {first:.2f} s", flush=True)
    print(f"up: best {min(ups):.2f} s, median {statistics.median(ups):.2f} s; first completion: "
          f"best {min(firsts):.2f} s, median {statistics.median(firsts):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
