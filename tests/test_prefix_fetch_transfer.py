"""Prefix fetches over the ZeroMQ side channel, in one process: a receiver asks for pages by their
hashes, and the sender's lender (``prefill_worker/prefix_loans.py``) lends them from where they
are (pool, host tier, disk tier), pinned until the fetch ends; nothing stays pinned after."""

from __future__ import annotations

import random
import threading
import time

import torch
from kv_sender_process import fill_pool, make_layout

from common.engine.kv_pool import KVPool
from common.engine.kv_tiers.block import PageKey
from common.engine.kv_tiers.mover import Job
from common.engine.kv_tiers.tiers import KVTiers
from common.engine.page_manager import PageManager
from common.hashing import page_hashes
from common.protocol import PrefixSource
from kvtransfer import PrefixLender, PrefixLoan, create_receiver, create_sender
from prefill_worker.prefix_loans import PrefixLoans

NUM_PAGES = 8


class Prefill:
    """A prefill worker's side of a prefix fetch: a pool with a prefix cache, host and disk tiers
    below it, and a ZeroMQ sender lending from all three."""

    def __init__(self, tmp_path, host: bool = True, disk: bool = True) -> None:
        layout = make_layout("int8")  # pages with scales: both travel
        self.pool = KVPool(layout, NUM_PAGES, "cpu")
        fill_pool(self.pool, 7)
        self.pages = PageManager(NUM_PAGES, layout.page_size)
        self.tiers = KVTiers(
            self.pool,
            host_bytes=4 * layout.bytes_per_page if host else 0,
            disk_dir=str(tmp_path / "disk") if disk else None,
            disk_bytes=1 << 20,
            fingerprint=1,
        )
        self.pages.tiers = self.tiers
        self.sender = create_sender("zmq", self.pool, "prefill-p")
        self.sender.lend_prefixes(PrefixLoans(self.pool, self.pages, self.tiers), 30)
        self.page_size = layout.page_size
        self.expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # hash -> bytes

    def key(self, tokens: list[int], index: int, hashes: list[int]) -> PageKey:
        chunk = tuple(tokens[index * self.page_size : (index + 1) * self.page_size])
        return PageKey(hashes[index], hashes[index - 1] if index else None, chunk)

    def in_pool(self, key: PageKey) -> None:
        (page_id,) = self.pages.allocate(1)
        self.pages.cache_page(page_id, key.page_hash, key.token_ids, key.parent)
        self.pages.free([page_id])  # cached and free, as a finished prompt's pages are
        self.expected[key.page_hash] = self._bytes_of(page_id)

    def in_host(self, key: PageKey, like_page: int) -> None:
        host = self.tiers.host
        assert host is not None
        slot = host.take_slot(key)
        host.data[slot].copy_(self.pool.data[like_page])
        host.scales[slot].copy_(self.pool.scales[like_page])
        self.expected[key.page_hash] = self._bytes_of(like_page)

    def on_disk(self, key: PageKey, like_page: int) -> None:
        disk = self.tiers.disk
        assert disk is not None
        data, scales = self._bytes_of(like_page)
        disk.put(key, data.numpy().tobytes(), scales.numpy().tobytes())
        self.expected[key.page_hash] = (data, scales)

    def _bytes_of(self, page_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        scales = self.pool.scale_bytes(page_id)
        assert scales is not None
        return self.pool.page_bytes(page_id).clone(), scales.clone()

    def nothing_pinned(self) -> bool:
        host = self.tiers.host
        refs = sum(self.pages.ref_count(p) for p in range(NUM_PAGES))
        return refs == 0 and (host is None or host.num_pinned() == 0)

    def close(self) -> None:
        self.sender.close()
        self.tiers.close()


def decode_receiver():
    return create_receiver("zmq", KVPool(make_layout("int8"), NUM_PAGES, "cpu"), "decode-d")


def run(sender, receiver, condition, timeout: float = 30.0) -> list:
    """Poll both sides until ``condition(results)`` holds; the receiver's results."""
    results: list = []
    deadline = time.monotonic() + timeout
    while not condition(results):
        assert time.monotonic() < deadline, "timed out"
        sender.poll()
        results += receiver.poll()
        time.sleep(0.001)
    return results


def prompt(num_pages: int, seed: int, page_size: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(num_pages * page_size)]
    return tokens, page_hashes(tokens, page_size)


def source(prefill: Prefill, num_pages: int) -> PrefixSource:
    return PrefixSource("prefill-p", "zmq", prefill.sender.endpoint, num_pages)


def test_pages_come_from_the_pool_host_and_disk_where_they_are(tmp_path):
    prefill, receiver = Prefill(tmp_path), decode_receiver()
    try:
        tokens, hashes = prompt(5, seed=1, page_size=prefill.page_size)
        keys = [prefill.key(tokens, i, hashes) for i in range(5)]
        prefill.in_pool(keys[0])
        prefill.in_pool(keys[1])
        prefill.in_host(keys[2], like_page=5)
        prefill.on_disk(keys[3], like_page=6)  # page 4 is held nowhere: the run ends before it
        dst = [7, 2, 5, 0, 3]
        receiver.start_prefix_fetch("p", source(prefill, 5), None, hashes, tokens, dst, 10)
        (result,) = run(prefill.sender, receiver, lambda r: r)
        assert result.ok, result.error
        assert result.num_pages == 4
        assert [p.tier for p in result.offered] == ["pool", "pool", "host", "disk"]
        for page, key, page_id in zip(result.offered, keys, dst, strict=False):
            assert (page.page_hash, page.parent, tuple(page.token_ids)) == (
                key.page_hash,
                key.parent,
                key.token_ids,
            )
            data, scales = prefill.expected[key.page_hash]
            assert torch.equal(receiver.pool.page_bytes(page_id), data)
            assert torch.equal(receiver.pool.scale_bytes(page_id), scales)
        # The receiver released the loan: the pool's references and the host pins are back.
        run(prefill.sender, receiver, lambda _: prefill.nothing_pinned())
        assert prefill.pages.num_free_pages == NUM_PAGES
    finally:
        receiver.close()
        prefill.close()


def test_a_page_is_lent_only_for_its_own_tokens_and_parent(tmp_path):
    """A hash alone is not a hit: pages asked for with other tokens are not lent."""
    prefill, receiver = Prefill(tmp_path), decode_receiver()
    try:
        tokens, hashes = prompt(2, seed=2, page_size=prefill.page_size)
        prefill.in_pool(prefill.key(tokens, 0, hashes))
        other = [t + 1 for t in tokens]
        dst = [0, 1]
        receiver.start_prefix_fetch("p", source(prefill, 2), None, hashes, other, dst, 10)
        (result,) = run(prefill.sender, receiver, lambda r: r)
        assert not result.ok and "none of the pages is held" in (result.error or "")
        assert prefill.nothing_pinned()
    finally:
        receiver.close()
        prefill.close()


def test_a_damaged_disk_block_ends_the_run_before_it(tmp_path):
    prefill, receiver = Prefill(tmp_path, host=False), decode_receiver()
    try:
        tokens, hashes = prompt(3, seed=3, page_size=prefill.page_size)
        keys = [prefill.key(tokens, i, hashes) for i in range(3)]
        prefill.in_pool(keys[0])
        prefill.on_disk(keys[1], like_page=4)
        prefill.on_disk(keys[2], like_page=5)
        disk = prefill.tiers.disk
        assert disk is not None
        path = disk.path(keys[1].page_hash)
        blob = bytearray(path.read_bytes())
        blob[-40] ^= 0xFF  # the checksum no longer matches
        path.write_bytes(bytes(blob))
        dst = [3, 4, 5]
        receiver.start_prefix_fetch("p", source(prefill, 3), None, hashes, tokens, dst, 10)
        (result,) = run(prefill.sender, receiver, lambda r: r)
        assert result.ok, result.error
        assert [p.tier for p in result.offered] == ["pool"]
        run(prefill.sender, receiver, lambda _: prefill.nothing_pinned())
    finally:
        receiver.close()
        prefill.close()


def test_an_abort_while_the_loan_is_read_from_disk_unpins_everything(tmp_path):
    prefill, receiver = Prefill(tmp_path), decode_receiver()
    try:
        tokens, hashes = prompt(3, seed=4, page_size=prefill.page_size)
        keys = [prefill.key(tokens, i, hashes) for i in range(3)]
        prefill.in_pool(keys[0])
        prefill.in_host(keys[1], like_page=3)
        prefill.on_disk(keys[2], like_page=4)
        # The mover is busy until the gate opens: the loan's disk read waits behind.
        gate = threading.Event()
        prefill.tiers.mover.submit(Job(lambda job: gate.wait(30)))
        receiver.start_prefix_fetch("p", source(prefill, 3), None, hashes, tokens, [0, 1, 2], 10)
        # Let the request reach the sender and its loan be made, then give up.
        run(prefill.sender, receiver, lambda _: not prefill.nothing_pinned())
        assert prefill.sender.lending()
        receiver.abort("p")
        (result,) = run(prefill.sender, receiver, lambda r: r)
        assert not result.ok and result.error == "aborted"
        run(prefill.sender, receiver, lambda _: prefill.nothing_pinned())
        gate.set()
        assert prefill.tiers.flush(30)
    finally:
        receiver.close()
        prefill.close()


def test_a_sender_that_lends_nothing_refuses(tmp_path):
    layout = make_layout("int8")
    sender = create_sender("zmq", KVPool(layout, NUM_PAGES, "cpu"), "prefill-p")
    receiver = decode_receiver()
    try:
        tokens, hashes = prompt(1, seed=5, page_size=layout.page_size)
        src = PrefixSource("prefill-p", "zmq", sender.endpoint, 1)
        receiver.start_prefix_fetch("p", src, None, hashes, tokens, [0], 10)
        (result,) = run(sender, receiver, lambda r: r)
        assert not result.ok
        assert "serves no prefix fetches" in (result.error or "")
    finally:
        receiver.close()
        sender.close()


class NeverReady(PrefixLender):
    """A lender whose loans never become ready (a disk that does not answer)."""

    def __init__(self) -> None:
        self.ended = 0

    def lend(self, parent, page_hashes, token_ids):
        lender = self

        class Stuck(PrefixLoan):
            ready = False
            pages = ()

            def rows(self):
                raise AssertionError("a loan that is not ready is never read")

            def end(self):
                lender.ended += 1

        return Stuck()


def test_a_loan_not_ready_by_the_end_of_its_lease_is_refused_and_ended():
    layout = make_layout("int8")
    sender = create_sender("zmq", KVPool(layout, NUM_PAGES, "cpu"), "prefill-p")
    lender = NeverReady()
    sender.lend_prefixes(lender, 0.2)
    receiver = decode_receiver()
    try:
        tokens, hashes = prompt(1, seed=6, page_size=layout.page_size)
        src = PrefixSource("prefill-p", "zmq", sender.endpoint, 1)
        receiver.start_prefix_fetch("p", src, None, hashes, tokens, [0], 30)
        (result,) = run(sender, receiver, lambda r: r)
        assert not result.ok
        assert "lease expired" in (result.error or "")
        assert lender.ended == 1
    finally:
        receiver.close()
        sender.close()
