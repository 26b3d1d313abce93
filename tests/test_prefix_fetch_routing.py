"""The router's side of prefix fetches: a request it prefills on a decode worker names the
prefill worker holding the longest run of its leading pages (pool, host or disk tier), only
between workers whose backend serves such fetches, never the last prompt token's page; the
registry's views say who lends and who fetches, and the dispatcher's DecodeRequest carries it."""

from __future__ import annotations

import asyncio
import time

from test_router_registry import beat, reg

from common.hashing import page_hashes
from common.messages import decode, encode
from common.protocol import CacheEvents, DecodeRequest, PrefixSource
from common.sampling_params import SamplingParams
from router.dispatcher import Dispatcher, Generation
from router.metrics import RouterMetrics
from router.policy import (
    REASON_OVERFLOW,
    REASON_PREFIX,
    REASON_SHORT_PROMPT,
    DecodeView,
    PrefillView,
    RequestView,
    RoutingConfig,
    WorkersView,
    prefix_source,
    route,
)
from router.registry import WorkerRegistry
from router.request_metrics import ServiceLevel

CONFIG = RoutingConfig(remote_prefill_min_tokens=64)
HASHES = list(range(100, 110))  # a prompt of 10 full pages and then some


def request(num_tokens: int = 16 * 10 + 5, **kw) -> RequestView:
    return RequestView(num_prompt_tokens=num_tokens, page_hashes=HASHES, page_size=16, **kw)


def prefill(wid: str, pool=(), host=(), disk=(), lends: bool = True, load: int = 0):
    return PrefillView(wid, load, 0, set(pool), host_hashes=set(host), disk_hashes=set(disk),
                       lends_prefixes=lends)  # fmt: skip


def decode_view(fetches: bool = True, load: int = 0) -> DecodeView:
    return DecodeView("d", 100, 0, load_tokens=load, fetches_prefixes=fetches)


def test_a_short_suffix_is_prefilled_locally_with_the_prefix_from_its_holder():
    # "tiers" holds the first 9 pages: 4 in its pool, 3 in host memory, 2 on disk.
    tiers = prefill("tiers", HASHES[:4], HASHES[4:7], HASHES[7:9])
    other = prefill("other", HASHES[:2])
    decision = route(request(), WorkersView([other, tiers], [decode_view()]), CONFIG)
    assert decision.prefill_worker_id is None
    assert decision.reason == REASON_SHORT_PROMPT
    assert (decision.prefix_worker_id, decision.prefix_pages) == ("tiers", 9)


def test_never_the_page_of_the_last_prompt_token():
    full = prefill("full", HASHES)
    # 160 tokens: the 10th page holds the last token, which is computed to sample the first.
    view = WorkersView([full], [decode_view()])
    assert prefix_source(request(160), view, "d", CONFIG) == ("full", 9)
    assert prefix_source(request(161), view, "d", CONFIG) == ("full", 10)


def test_no_fetch_where_a_side_cannot_or_none_holds_enough():
    holder = prefill("p", HASHES[:3])
    assert (
        prefix_source(request(), WorkersView([holder], [decode_view(False)]), "d", CONFIG) is None
    )
    no_lend = prefill("p", HASHES[:3], lends=False)
    assert prefix_source(request(), WorkersView([no_lend], [decode_view()]), "d", CONFIG) is None
    view = WorkersView([holder], [decode_view()])
    assert prefix_source(request(), view, "d", RoutingConfig(prefix_fetch=False)) is None
    assert prefix_source(request(), view, "d", RoutingConfig(prefix_fetch_min_pages=4)) is None
    assert prefix_source(request(lora_name="a"), view, "d", CONFIG) is None
    gap = prefill("p", HASHES[1:])  # the chain starts at the first page or not at all
    assert prefix_source(request(), WorkersView([gap], [decode_view()]), "d", CONFIG) is None


def test_ties_break_by_load_then_id():
    a, b = prefill("a", HASHES[:5], load=50), prefill("b", host=HASHES[:5], load=10)
    view = WorkersView([a, b], [decode_view()])
    assert prefix_source(request(), view, "d", CONFIG) == ("b", 5)
    c = prefill("c", disk=HASHES[:5], load=10)
    view = WorkersView([a, c, b], [decode_view()])
    assert prefix_source(request(), view, "d", CONFIG) == ("b", 5)


def test_an_overflow_fetches_too_and_a_remote_prefill_does_not():
    config = RoutingConfig(remote_prefill_min_tokens=8, local_prefill_overflow_tokens=100)
    busy = prefill("busy", HASHES[:3], load=500)
    decision = route(request(), WorkersView([busy], [decode_view()]), config)
    assert decision.reason == REASON_OVERFLOW
    assert (decision.prefix_worker_id, decision.prefix_pages) == ("busy", 3)
    idle = prefill("idle", HASHES[:3])
    decision = route(request(), WorkersView([idle], [decode_view()]), config)
    assert (decision.prefill_worker_id, decision.reason) == ("idle", REASON_PREFIX)
    assert decision.prefix_worker_id is None


def test_the_registry_says_who_lends_and_who_fetches():
    registry = WorkerRegistry("m", heartbeat_timeout=3)
    assert registry.register(reg("p", kv_endpoint="tcp://127.0.0.1:7"), 0) is None
    assert registry.register(reg("q"), 0) is None  # no side channel: lends nothing
    assert registry.register(reg("n", kv_transfer="nixl", kv_endpoint="tcp://h:1"), 0) is None
    assert registry.register(reg("d", role="decode"), 0) is None
    assert registry.register(reg("e", role="decode", kv_transfer="nixl"), 0) is None
    for wid in "pqnde":
        registry.on_heartbeat(beat(wid), 0)
    view = registry.view()
    assert {w.worker_id: w.lends_prefixes for w in view.prefill} == {
        "p": True,
        "q": False,
        "n": False,
    }
    assert {w.worker_id: w.fetches_prefixes for w in view.decode} == {"d": True, "e": False}


def test_a_decode_request_carries_its_prefix_source_over_the_wire():
    source = PrefixSource("prefill-0", "zmq", "tcp://127.0.0.1:5555", 9)
    msg = DecodeRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), prefix=source)
    assert decode(encode(msg)) == msg
    assert decode(encode(DecodeRequest("r", [1], SamplingParams()))).prefix is None


def test_the_index_a_fetch_is_chosen_from_is_the_workers_cache_events():
    registry = WorkerRegistry("m", heartbeat_timeout=3)
    assert registry.register(reg("p", kv_endpoint="tcp://127.0.0.1:7"), 0) is None
    assert registry.register(reg("d", role="decode"), 0) is None
    registry.on_heartbeat(beat("p"), 0)
    registry.on_heartbeat(beat("d"), 0)
    tokens = list(range(16 * 6 + 3))
    hashes = page_hashes(tokens, 16)
    registry.on_cache_events(CacheEvents("p", hashes[:2], []), 0)
    registry.on_cache_events(CacheEvents("p", hashes[2:5], [], tier="disk"), 0)
    req = RequestView(len(tokens), hashes, 16)
    decision = route(req, registry.view(), CONFIG)
    assert decision.reason == REASON_SHORT_PROMPT
    assert (decision.prefix_worker_id, decision.prefix_pages) == ("p", 5)


def test_the_dispatcher_names_the_prefix_source_in_the_decode_request():
    """A returning prompt whose uncached suffix is short goes to the decode worker, with where
    its leading pages are and how many: the prefill worker's side channel, from its
    registration."""
    registry = WorkerRegistry("m", heartbeat_timeout=30)
    now = time.monotonic()
    assert registry.register(reg("p", kv_endpoint="tcp://127.0.0.1:7"), now) is None
    assert registry.register(reg("d", role="decode"), now) is None
    for wid in "pd":
        registry.on_heartbeat(beat(wid), now)
    tokens = list(range(16 * 8 + 10))
    registry.on_cache_events(CacheEvents("p", page_hashes(tokens, 16)[:3], []), now)
    registry.on_cache_events(CacheEvents("p", page_hashes(tokens, 16)[3:], [], tier="host"), now)
    sent: list = []
    metrics = RouterMetrics(ServiceLevel(ttft_s=None, tpot_s=None))
    dispatcher = Dispatcher(
        registry, CONFIG, metrics, lambda wid, msg: sent.append((wid, msg)), 3, 1.0
    )
    gen = Generation("r", tokens, SamplingParams(max_tokens=4), asyncio.Queue(), 0, arrived_at=now)
    dispatcher.submit([gen])
    ((worker_id, msg),) = sent
    assert worker_id == "d" and isinstance(msg, DecodeRequest)
    assert msg.prefix == PrefixSource("p", "zmq", "tcp://127.0.0.1:7", 8)
