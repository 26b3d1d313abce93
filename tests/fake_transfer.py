"""An in-process KV transfer for unit tests: ``FakeSender`` and ``FakeReceiver`` keep the
``kvtransfer/base.py`` contract with no sockets and no threads, and the test decides when each
fetch ends and how.

A fetch stays in flight until the test calls ``FakeReceiver.complete`` (the pages arrive: copied
from the sender's pool when the receiver was given a sender with a pool) or
``FakeReceiver.fail``; either tells the sender, whose ``poll`` then frees the id. ``abort`` on
either side is reported by the next ``poll``, as the contract says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.engine.kv_pool import KVPool
from kvtransfer.base import (
    KVReceiver,
    KVSender,
    TransferError,
    TransferParams,
    TransferResult,
    check_page_ids,
)

BACKEND = "fake"


class FakeSender(KVSender):
    backend = BACKEND

    def __init__(self, pool: KVPool | None = None, engine_id: str = "fake-prefill") -> None:
        self.pool = pool
        self.engine_id = engine_id
        self.published: dict[str, TransferParams] = {}  # ids whose pages are not free yet
        self.aborted: list[str] = []  # every id ``abort`` was called for, in order
        self._freed: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"inproc://{self.engine_id}"

    def publish(
        self, transfer_id: str, page_ids: list[int], lease_seconds: float
    ) -> TransferParams:
        if transfer_id in self.published:
            raise ValueError(f"{transfer_id!r} is already published")
        if lease_seconds <= 0:
            raise ValueError(f"a lease must be positive, got {lease_seconds}")
        check_page_ids(page_ids, self.pool.num_pages if self.pool else None, "page_ids")
        params = TransferParams(
            BACKEND, self.endpoint, self.engine_id, list(page_ids), time.time() + lease_seconds
        )
        self.published[transfer_id] = params
        return params

    def release(self, transfer_id: str) -> None:
        """The receiver has the pages, or gave up on them: ``poll`` frees the id once."""
        if self.published.pop(transfer_id, None) is not None:
            self._freed.append(transfer_id)

    def poll(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def serve_requests(self) -> None:
        pass

    def serve_transfers(self) -> None:
        """Nothing moves by itself: a fetch ends when the test completes or fails it."""

    def poll_sockets(self) -> list:
        return []

    def abort(self, transfer_id: str) -> None:
        self.aborted.append(transfer_id)
        self.release(transfer_id)

    def close(self) -> None:
        self.published.clear()


@dataclass(slots=True)
class Fetch:
    params: TransferParams
    dst_page_ids: list[int]
    started: float


class FakeReceiver(KVReceiver):
    backend = BACKEND

    def __init__(self, pool: KVPool, sender: FakeSender | None = None) -> None:
        self.pool = pool
        self.sender = sender
        self.in_flight: dict[str, Fetch] = {}
        self.started: list[tuple[str, list[int]]] = []  # (id, destination pages), in order
        self.aborted: list[str] = []  # every id ``abort`` was called for, in order
        self._ended: list[TransferResult] = []

    def start_fetch(
        self,
        transfer_id: str,
        params: TransferParams,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        if params.backend != self.backend:
            raise TransferError(f"params of the {params.backend!r} backend")
        if len(params.page_ids) != len(dst_page_ids):
            raise TransferError(
                f"{len(params.page_ids)} pages offered for {len(dst_page_ids)} destinations"
            )
        check_page_ids(dst_page_ids, self.pool.num_pages, "dst_page_ids")
        if transfer_id in self.in_flight:
            raise TransferError(f"{transfer_id!r} is already being fetched")
        self.in_flight[transfer_id] = Fetch(params, list(dst_page_ids), time.monotonic())
        self.started.append((transfer_id, list(dst_page_ids)))

    def complete(self, transfer_id: str) -> None:
        """The fetch succeeds: its pages are copied in (from the sender's pool, if there is one)."""
        fetch = self.in_flight[transfer_id]
        source = self.sender.pool if self.sender is not None else None
        if source is not None:
            for src, dst in zip(fetch.params.page_ids, fetch.dst_page_ids, strict=True):
                self.pool.data[dst].copy_(source.data[src])
                if self.pool.scales is not None:
                    self.pool.scales[dst].copy_(source.scales[src])
        self._end(transfer_id, None)

    def fail(self, transfer_id: str, error: str = "the lease ran out") -> None:
        self._end(transfer_id, error)

    def poll(self) -> list[TransferResult]:
        ended, self._ended = self._ended, []
        return ended

    def serve_transfers(self) -> None:
        """Nothing moves by itself: a fetch ends when the test completes or fails it."""

    def poll_sockets(self) -> list:
        return []

    def abort(self, transfer_id: str) -> None:
        self.aborted.append(transfer_id)
        if transfer_id in self.in_flight:
            self._end(transfer_id, "aborted")

    def close(self) -> None:
        for transfer_id in list(self.in_flight):
            self.abort(transfer_id)

    def _end(self, transfer_id: str, error: str | None) -> None:
        fetch = self.in_flight.pop(transfer_id)
        num_pages = len(fetch.dst_page_ids)
        nbytes = num_pages * self.pool.layout.bytes_per_page if error is None else 0
        seconds = time.monotonic() - fetch.started
        result = TransferResult(transfer_id, error is None, error, num_pages, nbytes, seconds)
        self._ended.append(result)
        if self.sender is not None:
            self.sender.release(transfer_id)
