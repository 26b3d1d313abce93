"""The decode side of a prefix fetch (``decode_worker/prefix_fetches.py``) over a real ZeroMQ
sender and receiver in one process: only the pages this pool lacks are asked for, a page that is
not the prompt's is a miss (it and the rest are computed), the pages that check are filed in the
prefix cache, and every page reserved goes back whatever happens."""

from __future__ import annotations

import time

import torch
from kv_sender_process import fill_pool, make_layout
from test_prefix_fetch_transfer import NUM_PAGES, Prefill, prompt

from common.engine.kv_pool import KVPool
from common.engine.page_manager import PageManager
from common.engine.sequence import Sequence
from common.protocol import PrefixSource
from common.sampling_params import SamplingParams
from decode_worker.prefix_fetches import PrefixFetches
from kvtransfer import OfferedPage, PrefixLender, PrefixLoan, create_receiver

DECODE_PAGES = 16


class Reserving:
    """The decode scheduler's reservations (``DecodeScheduler.reserve``), over a page manager."""

    def __init__(self, pages: PageManager) -> None:
        self.pages = pages
        self.page_size = pages.page_size

    def reserve(self, num_prompt_tokens: int) -> list[int] | None:
        count = -(-num_prompt_tokens // self.page_size)
        return self.pages.allocate(count) if count <= self.pages.num_free_pages else None

    def drop_reservation(self, page_ids: list[int]) -> None:
        self.pages.free(page_ids)


class Decode:
    def __init__(self) -> None:
        layout = make_layout("int8")
        self.pool = KVPool(layout, DECODE_PAGES, "cpu")
        self.pages = PageManager(DECODE_PAGES, layout.page_size)
        self.receiver = create_receiver("zmq", self.pool, "decode-d")
        self.admitted: list[Sequence] = []
        self.fetches = PrefixFetches(
            self.receiver,
            Reserving(self.pages),
            self.pages,
            admit=lambda seq: self.admitted.append(seq) is None,
            fetch_timeout=10,
            page_nbytes=layout.bytes_per_page,
        )

    def run(self, sender, condition, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            sender.poll()
            for result in self.receiver.poll():
                assert self.fetches.on_result(result)
            time.sleep(0.001)


def request(tokens: list[int]) -> Sequence:
    return Sequence.from_prompt("r", tokens, SamplingParams(max_tokens=2))


def test_only_the_pages_this_pool_lacks_are_fetched_and_filed(tmp_path):
    prefill, decode = Prefill(tmp_path), Decode()
    try:
        page_size = prefill.page_size
        tokens, hashes = prompt(4, seed=7, page_size=page_size)
        tokens = [*tokens, 5]  # a last token of its own: the 4 full pages may be fetched
        keys = [prefill.key(tokens, i, hashes) for i in range(4)]
        for key in keys[:2]:
            prefill.in_pool(key)
        prefill.in_host(keys[2], like_page=6)
        prefill.in_host(keys[3], like_page=7)
        # This pool holds the first page already.
        (own,) = decode.pages.allocate(1)
        decode.pages.cache_page(own, hashes[0], keys[0].token_ids, None)
        decode.pages.free([own])
        source = PrefixSource("prefill-p", "zmq", prefill.sender.endpoint, 4)
        decode.fetches.admit(request(tokens), source)
        assert decode.fetches.num_pending() == 1 and not decode.admitted
        decode.run(prefill.sender, lambda: decode.admitted)
        assert decode.pages.match_prefix(tokens) and len(decode.pages.match_prefix(tokens)) == 4
        for key, page_id in zip(keys[1:], decode.pages.match_prefix(tokens)[1:], strict=True):
            data, scales = prefill.expected[key.page_hash]
            assert torch.equal(decode.pool.page_bytes(page_id), data)
            assert torch.equal(decode.pool.scale_bytes(page_id), scales)
        assert decode.pages.num_free_pages == DECODE_PAGES  # filed and free, none held
        decode.run(prefill.sender, prefill.nothing_pinned)
    finally:
        decode.receiver.close()
        prefill.close()


class Lying(PrefixLender):
    """Lends a run of pages whose second page says it holds other tokens than asked."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.ended = 0

    def lend(self, parent, page_hashes, token_ids):
        size = self.pool.layout.page_size
        pages = [
            OfferedPage(
                h, page_hashes[i - 1] if i else parent, token_ids[i * size : (i + 1) * size], "pool"
            )
            for i, h in enumerate(page_hashes)
        ]
        pages[1].token_ids = [t + 1 for t in pages[1].token_ids]
        lender = self

        class Loan(PrefixLoan):
            ready = True

            @property
            def pages(self):
                return pages

            def rows(self):
                count = range(len(pages))
                return [
                    [lender.pool.page_bytes(i).numpy() for i in count],
                    [lender.pool.scale_bytes(i).numpy() for i in count],
                ]

            def end(self):
                lender.ended += 1

        return Loan()


def test_a_page_that_is_not_the_prompts_is_a_miss_and_so_is_the_rest():
    from kvtransfer import create_sender

    pool = KVPool(make_layout("int8"), NUM_PAGES, "cpu")
    fill_pool(pool, 3)
    sender = create_sender("zmq", pool, "prefill-p")
    lender = Lying(pool)
    sender.lend_prefixes(lender, 30)
    decode = Decode()
    try:
        tokens, _hashes = prompt(3, seed=8, page_size=pool.layout.page_size)
        tokens = [*tokens, 1]
        decode.fetches.admit(request(tokens), PrefixSource("prefill-p", "zmq", sender.endpoint, 3))
        decode.run(sender, lambda: decode.admitted)
        assert len(decode.pages.match_prefix(tokens)) == 1  # page 0 only: page 1 lied
        assert decode.pages.num_free_pages == DECODE_PAGES
        decode.run(sender, lambda: lender.ended == 1)
    finally:
        decode.receiver.close()
        sender.close()


def test_a_discarded_fetch_frees_its_pages_and_admits_nothing(tmp_path):
    prefill, decode = Prefill(tmp_path), Decode()
    try:
        tokens, hashes = prompt(3, seed=9, page_size=prefill.page_size)
        tokens = [*tokens, 2]
        for index in range(3):
            prefill.on_disk(prefill.key(tokens, index, hashes), like_page=index)
        source = PrefixSource("prefill-p", "zmq", prefill.sender.endpoint, 3)
        decode.fetches.admit(request(tokens), source)
        assert decode.pages.num_free_pages == DECODE_PAGES - 3
        assert decode.fetches.discard("r")
        assert not decode.fetches.discard("r")
        decode.run(prefill.sender, lambda: decode.pages.num_free_pages == DECODE_PAGES)
        assert not decode.admitted and decode.fetches.num_pending() == 0
        assert not decode.pages.match_prefix(tokens)
        decode.run(prefill.sender, prefill.nothing_pinned)
    finally:
        decode.receiver.close()
        prefill.close()


def test_without_room_or_anything_to_fetch_the_prompt_is_admitted_at_once(tmp_path):
    decode = Decode()
    try:
        tokens, _ = prompt(3, seed=10, page_size=8)
        source = PrefixSource("prefill-p", "zmq", "tcp://127.0.0.1:9", 3)
        decode.fetches.admit(request(tokens[:8]), source)  # one page: the last token's
        assert len(decode.admitted) == 1
        decode.pages.allocate(DECODE_PAGES)  # no room
        decode.fetches.admit(request([*tokens, 1]), source)
        assert len(decode.admitted) == 2 and decode.fetches.num_pending() == 0
    finally:
        decode.receiver.close()
