"""The worker registry: membership, heartbeats, timeouts and the exact prefix index."""

from __future__ import annotations

from common.kv_layout import KVLayout
from common.messages import PROTOCOL_VERSION
from common.protocol import CacheEvents, Heartbeat, RegisterWorker
from router.registry import WorkerRegistry


def layout(page_size: int) -> KVLayout:
    return KVLayout("bfloat16", page_size, 2, 2, 64)


def reg(wid: str, role: str = "prefill", **kw) -> RegisterWorker:
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        worker_id=wid,
        incarnation=f"{wid}-1",
        role=role,
        model="m",
        kv_layout=layout(16),
        kv_transfer="zmq",
        num_pages=100,
        max_model_len=2048,
        metrics_url="http://127.0.0.1:9/metrics",
        handoff_endpoint="tcp://127.0.0.1:9" if role == "decode" else None,
    )
    fields.update(kw)
    return RegisterWorker(**fields)


def beat(wid: str, queued: int = 0, free: int = 100) -> Heartbeat:
    return Heartbeat(wid, 1, 0, queued, free, 0.1)


def test_register_checks_version_model_role_and_layout():
    r = WorkerRegistry("m", heartbeat_timeout=3)
    old = PROTOCOL_VERSION - 1  # a worker left from before an upgrade: both versions named
    assert r.register(reg("a", protocol_version=old), 0) == (
        f"protocol version {old} does not match the router's {PROTOCOL_VERSION}"
    )
    assert "a" not in r.workers
    assert "model" in r.register(reg("a", model="other"), 0)
    assert "role" in r.register(reg("a", role="both"), 0)
    assert "handoff_endpoint" in r.register(reg("a", role="decode", handoff_endpoint=None), 0)
    assert r.register(reg("a"), 0) is None
    assert "page_size" in r.register(reg("b", kv_layout=layout(32)), 0)
    # A layout this version cannot serve is refused, saying why (it decodes: its shape is kept).
    unknown = KVLayout("float4", 16, 2, 2, 64)
    assert "unsupported KV cache dtype 'float4'" in r.register(reg("b", kv_layout=unknown), 0)
    empty = KVLayout("bfloat16", 0, 2, 2, 64)
    assert "page_size must be a positive int" in r.register(reg("b", kv_layout=empty), 0)
    assert list(r.workers) == ["a"]


def test_a_pool_is_deterministic_throughout_or_not_at_all():
    """One worker without batch-invariant kernels would make an answer depend on the route."""
    r = WorkerRegistry("m", heartbeat_timeout=3)
    assert r.deterministic is None
    assert r.register(reg("p0", deterministic=True), 0) is None
    assert r.register(reg("d0", role="decode", deterministic=True), 0) is None
    assert r.deterministic is True
    refusal = r.register(reg("d1", role="decode"), 0)
    assert "deterministic inference is off on this worker and on on the registered" in refusal
    assert r.workers["p0"].describe()["deterministic_inference"] is True
    # A worker restarting under its id is weighed against the others only: alone, it may
    # come back either way.
    assert "deterministic" in r.register(reg("p0"), 0)
    r.remove("d0")
    assert r.register(reg("p0"), 0) is None
    assert r.deterministic is False
    r.remove("p0")
    assert r.deterministic is None


def test_heartbeats_keep_a_worker_and_silence_expires_it():
    r = WorkerRegistry("m", heartbeat_timeout=3)
    r.register(reg("a"), now=0)
    r.register(reg("d", "decode"), now=0)
    r.on_heartbeat(beat("a", queued=7), now=2.5)
    assert r.expired(now=3.5) == ["d"]
    assert r.workers["a"].queued_prefill_tokens == 7
    r.remove("d")
    assert r.expired(now=6.0) == ["a"]
    r.on_heartbeat(beat("ghost"), now=1)  # unknown workers are ignored
    assert "ghost" not in r.workers


def test_prefix_index_follows_stored_removed_and_reset_events():
    r = WorkerRegistry("m", heartbeat_timeout=3)
    r.register(reg("a"), 0)
    r.register(reg("b"), 0)
    r.on_cache_events(CacheEvents("a", [1, 2, 3], []), 0)
    r.on_cache_events(CacheEvents("b", [1, 9], []), 0)
    assert r.cached_hashes("a") == {1, 2, 3} and r.cached_hashes("b") == {1, 9}
    r.on_cache_events(CacheEvents("a", [4], [2]), 0)
    assert r.cached_hashes("a") == {1, 3, 4}
    r.on_cache_events(CacheEvents("a", [5], [], reset=True), 0)
    assert r.cached_hashes("a") == {5} and r.cached_hashes("b") == {1, 9}
    r.remove("b")
    assert r.cached_hashes("b") == set() and r.cached_hashes("a") == {5}


def test_load_is_counted_at_dispatch_until_reported():
    r = WorkerRegistry("m", heartbeat_timeout=3)
    r.register(reg("a"), 0)
    r.on_dispatch("a", "r1", prefill_tokens=100, pages=0, now=1.0)
    assert r.view().prefill[0].load_tokens == 100
    assert r.view().prefill[0].num_inflight == 1
    r.on_heartbeat(beat("a", queued=100), now=1.5)  # may or may not include r1 yet
    assert r.workers["a"].load_tokens == 200
    r.on_heartbeat(beat("a", queued=100), now=2.5)  # a full interval later: r1 is reported
    assert r.workers["a"].load_tokens == 100
    r.on_dispatch("a", "r2", prefill_tokens=50, pages=0, now=3.0)
    r.on_prefilled("a", "r2")  # its first token arrived: its prompt is computed
    assert r.workers["a"].load_tokens == 100
    r.on_released("a", "r1")
    r.on_released("a", "r2")
    assert r.view().prefill[0].num_inflight == 0


def test_decode_headroom_subtracts_dispatched_pages():
    r = WorkerRegistry("m", heartbeat_timeout=3)
    r.register(reg("d", "decode"), 0)
    r.on_heartbeat(beat("d", free=80), 0)
    r.on_dispatch("d", "r1", 0, pages=30, now=1)
    view = r.view().decode[0]
    assert (view.free_pages, view.num_running) == (50, 2)
    assert r.workers["d"].describe()["metrics_url"].endswith("/metrics")


def test_dispatcher_never_reuses_another_prompts_page_hashes():
    """The dispatcher keeps the last prompt's hashes for its next choice or retry. A new prompt
    whose list happens to sit where a freed one did (same id()) must be hashed afresh: with
    stale hashes it was routed as if an old prompt's pages held it."""
    from common.hashing import page_hashes
    from router.dispatcher import Dispatcher
    from router.metrics import RouterMetrics
    from router.policy import RoutingConfig

    dispatcher = Dispatcher(
        WorkerRegistry("m", 3.0), RoutingConfig(), RouterMetrics(), lambda *_: None, 3, 1.0
    )
    for i in range(200):
        tokens = [i, *range(63)]  # a new list each time, often where the last one was
        assert dispatcher._hashes(tokens, 16) == page_hashes(tokens, 16)
        assert dispatcher._hashes(tokens, 16) == page_hashes(tokens, 16)  # the kept copy
        tokens[5] = -1  # the same list, changed in place: hashed afresh
        assert dispatcher._hashes(tokens, 16) == page_hashes(tokens, 16)
        del tokens
