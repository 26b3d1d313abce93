"""A prefill-side KV sender in its own process, driven by the KV-transfer tests.

Run as ``PYTHONPATH=. python tests/kv_sender_process.py zmq:bf16 nixl:fp8 ...``: one sender per
spec, each over its own pool of pages filled from a fixed seed (``fill_pool``), so a test can
recompute the bytes it expects. Commands arrive on stdin as JSON lines and carry an ``id`` that
the reply repeats; released request ids are reported unprompted. The loop polls every sender
each iteration, like a worker's main loop, and exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

import torch
from prometheus_client import REGISTRY

from common.engine.kv_pool import KVPool, kv_layout
from common.kv_layout import KVLayout
from common.messages import to_wire
from kvtransfer.registry import create_sender

NUM_PAGES = 16
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def make_layout(dtype: str, num_kv_heads: int = 2) -> KVLayout:
    return kv_layout(
        DTYPES[dtype], page_size=8, num_layers=3, num_kv_heads=num_kv_heads, head_dim=16
    )


def fill_pool(pool: KVPool, seed: int) -> None:
    """Deterministic random bytes in every page (and scale), the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    raw = pool.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))
    if pool.scales is not None and pool.scales.is_floating_point():
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=generator) + 0.5)
    elif pool.scales is not None:  # one-byte codes: any byte is a scale
        codes = torch.randint(0, 256, pool.scales.shape, generator=generator, dtype=torch.uint8)
        pool.scales.copy_(codes)


def seed_of(spec: str) -> int:
    return sum(map(ord, spec))


def main(specs: list[str]) -> None:
    global _out
    # Replies get a private copy of stdout; anything else printed (library logs) goes to stderr.
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    senders = {}
    for spec in specs:
        backend, dtype = spec.split(":")
        pool = KVPool(make_layout(dtype), NUM_PAGES, "cpu")
        fill_pool(pool, seed_of(spec))
        senders[spec] = create_sender(backend, pool, engine_id=f"prefill-{backend}-{dtype}")
    frozen_on_fetch: set[str] = set()
    for spec, sender in senders.items():
        _emit({"event": "ready", "key": spec, "endpoint": sender.endpoint})
    while True:
        for spec, sender in senders.items():
            if spec in frozen_on_fetch:
                # Stands in for a process that died (or hung) in the middle of a transfer: the
                # fetch has arrived and will never be answered. Not polled meanwhile, so that a
                # fetch arriving between the peek and a poll cannot be served.
                if _has_fetch(sender):
                    _emit({"event": "frozen", "key": spec})
                    time.sleep(3600)
                continue
            for transfer_id in sender.poll():
                _emit({"event": "released", "key": spec, "transfer_id": transfer_id})
        readable, _, _ = select.select([sys.stdin], [], [], 0.002)
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        command = json.loads(line)
        sender = senders[command["key"]]
        reply: dict = {"id": command["id"]}
        if command["cmd"] == "publish":
            params = sender.publish(command["transfer_id"], command["page_ids"], command["lease"])
            reply["params"] = to_wire(params)
        elif command["cmd"] == "abort":
            sender.abort(command["transfer_id"])
        elif command["cmd"] == "freeze_on_fetch":
            frozen_on_fetch.add(command["key"])
        elif command["cmd"] == "bad_messages":
            labels = {"backend": command["key"].split(":")[0], "side": "sender"}
            name = "pdserve_kv_transfer_bad_messages_total"
            reply["value"] = REGISTRY.get_sample_value(name, labels) or 0.0
        _emit(reply)


def _has_fetch(sender) -> bool:
    """Whether a fetch request is waiting on the sender's side channel (peeked, not consumed)."""
    return bool(sender._channel.socket.poll(0))


_out = sys.stdout


def _emit(record: dict) -> None:
    _out.write(json.dumps(record) + "\n")
    _out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
