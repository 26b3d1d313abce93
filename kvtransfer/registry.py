"""Picks a KV-transfer backend by name; a backend's module is imported only when chosen, so a
worker on the ZeroMQ backend never loads NIXL."""

from __future__ import annotations

import importlib

from common.engine.kv_pool import KVPool
from kvtransfer.base import KVReceiver, KVSender

# name -> (module, sender class, receiver class)
_BACKENDS = {
    "zmq": ("kvtransfer.zmq_backend", "ZmqSender", "ZmqReceiver"),
    "nixl": ("kvtransfer.nixl_backend", "NixlSender", "NixlReceiver"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_sender(
    backend: str, pool: KVPool, engine_id: str, host: str = "127.0.0.1", port: int = 0
) -> KVSender:
    return _load(backend, 1)(pool, engine_id, host, port)


def create_receiver(backend: str, pool: KVPool, engine_id: str) -> KVReceiver:
    return _load(backend, 2)(pool, engine_id)


def _load(backend: str, index: int) -> type:
    if backend not in _BACKENDS:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; choose one of "
            f"{', '.join(available_backends())}"
        )
    entry = _BACKENDS[backend]
    return getattr(importlib.import_module(entry[0]), entry[index])
