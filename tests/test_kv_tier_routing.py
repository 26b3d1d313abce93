"""Routing that knows the KV tiers: cache events carry their tier, the router's index keeps a
prefix while any tier of a worker holds it, and the policy weighs a match by its tier, so a
prompt goes to the worker whose host tier holds its prefix after that worker's pool evicted it."""

from __future__ import annotations

import msgpack
import pytest
from engines import build_engine
from test_router_registry import beat, reg
from tiny_models import build_tiny_model, random_prompts
from worker_harness import FakeRouter

from common.hashing import page_hashes
from common.messages import decode, encode
from common.protocol import CacheEvents
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library
from router.policy import REASON_PREFIX, RequestView, RoutingConfig, overlap_tokens, route
from router.registry import WorkerRegistry

CONFIG = RoutingConfig(remote_prefill_min_tokens=0, host_hit_weight=0.9, disk_hit_weight=0.5)


def registry_of(*prefill_ids: str) -> WorkerRegistry:
    registry = WorkerRegistry("m", heartbeat_timeout=3)
    for wid in prefill_ids:
        assert registry.register(reg(wid), 0) is None
        registry.on_heartbeat(beat(wid), 0)
    assert registry.register(reg("d", role="decode"), 0) is None
    registry.on_heartbeat(beat("d"), 0)
    return registry


def request(hashes: list[int]) -> RequestView:
    return RequestView(num_prompt_tokens=16 * len(hashes) + 5, page_hashes=hashes, page_size=16)


def test_a_frame_without_a_tier_is_of_the_pool():
    """A worker of before the tiers sends no ``tier``: its events are its pool's."""
    raw = msgpack.unpackb(encode(CacheEvents("w", [1, 2], [])))
    del raw["tier"]
    msg = decode(msgpack.packb(raw))
    assert isinstance(msg, CacheEvents) and msg.tier == "device"


def test_the_index_keeps_a_prefix_while_a_tier_below_holds_it():
    registry = registry_of("a")
    registry.on_cache_events(CacheEvents("a", [1, 2, 3], []), 0)
    # The pool evicts the pages; the host tier takes them; the disk tier has the first.
    registry.on_cache_events(CacheEvents("a", [], [1, 2, 3]), 0)
    registry.on_cache_events(CacheEvents("a", [1, 2, 3], [], tier="host"), 0)
    registry.on_cache_events(CacheEvents("a", [1], [], tier="disk"), 0)
    assert registry.cached_hashes("a") == set()
    assert registry.cached_hashes("a", "host") == {1, 2, 3}
    view = registry.view().prefill[0]
    assert overlap_tokens(request([1, 2, 3, 4]), view, CONFIG) == int(3 * 0.9 * 16)
    registry.on_cache_events(CacheEvents("a", [], [2, 3], tier="host"), 0)
    assert overlap_tokens(request([1, 2, 3, 4]), registry.view().prefill[0], CONFIG) == int(
        0.9 * 16
    )
    # A reset of one tier replaces that tier only; an unknown tier is ignored.
    registry.on_cache_events(CacheEvents("a", [7], [], reset=True, tier="host"), 0)
    registry.on_cache_events(CacheEvents("a", [9], [], tier="tape"), 0)
    assert registry.cached_hashes("a", "host") == {7}
    assert registry.cached_hashes("a", "disk") == {1}


def test_a_match_is_weighed_by_its_tier():
    registry = registry_of("pool", "host", "disk")
    registry.on_cache_events(CacheEvents("pool", [1, 2], []), 0)
    registry.on_cache_events(CacheEvents("host", [1, 2, 3], [], tier="host"), 0)
    registry.on_cache_events(CacheEvents("disk", [1, 2, 3, 4], [], tier="disk"), 0)
    view = registry.view()
    overlaps = {w.worker_id: overlap_tokens(request([1, 2, 3, 4]), w, CONFIG) for w in view.prefill}
    assert overlaps == {"pool": 32, "host": int(3 * 0.9 * 16), "disk": 32}
    decision = route(request([1, 2, 3, 4]), view, CONFIG)
    assert (decision.prefill_worker_id, decision.reason) == ("host", REASON_PREFIX)
    # With every page in the pool, nothing changes from before the tiers.
    assert overlap_tokens(request([1, 2]), view.prefill[0], CONFIG) == 32


@pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")
def test_the_router_sends_a_prompt_to_the_worker_whose_host_tier_holds_it(tmp_path):
    """A real engine's events, through the wire codec, into the registry: after its pool
    evicted the prompt's pages the worker still gets the prompt, for its host tier."""
    folder = build_tiny_model("qwen2-bias", tmp_path / "model")
    engine = build_engine(folder, num_pages=12, max_model_len=160, kv_offloading_size=1 << 20)
    registry = registry_of("idle", "tiered")

    def report() -> None:
        pool = engine.page_manager.drain_events()
        events = [CacheEvents("tiered", pool.stored, pool.removed)]
        for below in engine.tiers.drain_events():
            events.append(CacheEvents("tiered", below.stored, below.removed, tier=below.tier))
        for msg in events:
            registry.on_cache_events(decode(encode(msg)), 0)

    prompt, *fillers = random_prompts(4, seed=5, min_len=70, max_len=70)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([prompt], params)
    report()
    hashes = page_hashes(prompt, 16)
    assert set(hashes) <= registry.cached_hashes("tiered")
    engine.generate(fillers, params)  # evicts the prompt's pages
    report()
    assert not set(hashes) & registry.cached_hashes("tiered")
    assert set(hashes) <= registry.cached_hashes("tiered", "host")
    view = registry.view()
    req = RequestView(len(prompt), hashes, 16)
    decision = route(req, view, CONFIG)
    assert (decision.prefill_worker_id, decision.reason) == ("tiered", REASON_PREFIX)
    engine.close()


@pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")
def test_a_worker_reports_its_host_tier_and_serves_from_it(tmp_path):
    """A worker process with a host tier: the pages its pool evicts are reported to the router
    as the host tier's, and the prompt that comes back is served from there, same tokens."""
    folder = build_tiny_model("qwen2-bias", tmp_path / "model")
    router = FakeRouter(tmp_path)
    try:
        # 12 pages of 8 KiB: the pool holds two of these prompts with their answers.
        flags = ("--kv-cache-memory", "192KiB", "--max-model-len", "160")
        router.start_worker("decode", folder, *flags, "--kv-offloading-size", "0.001")
        (worker,) = router.wait_registered(1)
        prompt, *fillers = random_prompts(4, seed=5, min_len=70, max_len=70)
        greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        for request_id, tokens in (
            ("first", prompt),
            *((f"f{i}", f) for i, f in enumerate(fillers)),
        ):
            router.decode_locally(request_id, tokens, greedy)
            router.wait_finished([request_id])
        hashes = set(page_hashes(prompt, 16)[:4])

        def in_host_tier() -> set[int]:
            events = router.cache_events.get(worker.worker_id, [])
            held: set[int] = set()
            for msg in events:
                if msg.tier == "host":
                    held = (held | set(msg.stored)) - set(msg.removed)
            return held

        router.wait_for(lambda: hashes <= in_host_tier(), 60, "the host tier's events")
        router.decode_locally("again", prompt, greedy)
        router.wait_finished(["again"])
        assert router.log("again").token_ids == router.log("first").token_ids
        assert router.log("again").deltas[0].num_cached_tokens == 64
        assert router.metrics("decode")['pdserve_kv_tier_hits_total{tier="host"}'] >= 4
    finally:
        router.stop()
