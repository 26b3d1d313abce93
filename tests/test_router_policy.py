"""The routing policy as a pure function: no sockets, no clock."""

from __future__ import annotations

import pytest

from common.hashing import page_hashes
from router.policy import (
    REASON_IMBALANCE,
    REASON_LOAD,
    REASON_MIGRATION,
    REASON_NO_PREFILL,
    REASON_OVERFLOW,
    REASON_PREFIX,
    REASON_SESSION,
    REASON_SESSION_OVERFLOW,
    REASON_SHORT_PROMPT,
    DecodeView,
    NoWorkerError,
    PrefillView,
    RequestView,
    RoutingConfig,
    WorkersView,
    route,
)

BS = 16
CONFIG = RoutingConfig(remote_prefill_min_tokens=64)
DECODE = [DecodeView("d0", free_pages=1000, num_running=0)]


def request(tokens: list[int], session: str | None = None, **kw) -> RequestView:
    return RequestView(len(tokens), page_hashes(tokens, BS), BS, 16, session, **kw)


def prefill(wid: str, load: int = 0, cached: list[int] = (), inflight: int = 0) -> PrefillView:
    return PrefillView(wid, load, inflight, frozenset(cached))


PROMPT = list(range(256))
HASHES = page_hashes(PROMPT, BS)


def test_prefix_overlap_wins():
    workers = WorkersView([prefill("a"), prefill("b", cached=HASHES[:8])], DECODE)
    d = route(request(PROMPT), workers, CONFIG)
    assert (d.prefill_worker_id, d.reason, d.num_cached_tokens) == ("b", REASON_PREFIX, 128)


def test_overlap_counts_only_a_leading_chain():
    # Holding later pages without the first ones is no hit at all.
    workers = WorkersView([prefill("a", load=10), prefill("b", cached=HASHES[1:])], DECODE)
    d = route(request(PROMPT), workers, CONFIG)
    assert (d.prefill_worker_id, d.reason) == ("b", REASON_LOAD)


def test_load_term_outweighs_a_small_overlap():
    # b holds 32 tokens but has 500 queued; a is idle: 256 < 224 + 500.
    workers = WorkersView([prefill("a"), prefill("b", load=500, cached=HASHES[:2])], DECODE)
    assert route(request(PROMPT), workers, CONFIG).prefill_worker_id == "a"


def test_ties_break_by_load():
    workers = WorkersView([prefill("a", load=0), prefill("b", load=0)], DECODE)
    assert route(request(PROMPT), workers, CONFIG).prefill_worker_id == "a"
    # Equal cost (overlap 64 tokens offsets 64 queued tokens): the less loaded one wins.
    workers = WorkersView([prefill("a", load=64, cached=HASHES[:4]), prefill("b", 0)], DECODE)
    config = RoutingConfig(remote_prefill_min_tokens=0, imbalance_slack_tokens=10_000)
    assert route(request(PROMPT), workers, config).prefill_worker_id == "b"


def test_imbalance_guard_keeps_a_prefix_holder_from_becoming_a_hot_spot():
    config = RoutingConfig(imbalance_factor=2.0, imbalance_slack_tokens=100, load_weight=0.0)
    hot = prefill("hot", load=1000, cached=HASHES[:8])
    workers = WorkersView([hot, prefill("cold", load=200)], DECODE)
    d = route(request(PROMPT), workers, config)
    assert (d.prefill_worker_id, d.reason) == ("cold", REASON_IMBALANCE)
    # Within the bound, the prefix holder keeps it.
    hot = prefill("hot", load=400, cached=HASHES[:8])
    d = route(request(PROMPT), WorkersView([hot, prefill("cold", load=200)], DECODE), config)
    assert (d.prefill_worker_id, d.reason) == ("hot", REASON_PREFIX)


def test_session_sticks_and_overflows_when_over_its_bound():
    workers = [prefill(f"w{i}") for i in range(3)]
    first = route(request(PROMPT, "alice"), WorkersView(workers, DECODE), CONFIG)
    assert first.reason == REASON_SESSION
    # The same session keeps its worker as others' load moves around.
    loaded = [prefill(w.worker_id, load=500 * i, inflight=1) for i, w in enumerate(workers)]
    again = route(request(PROMPT, "alice"), WorkersView(loaded, DECODE), CONFIG)
    assert again.prefill_worker_id == first.prefill_worker_id
    # Over the bound ((1 + 0.25) * mean in-flight), it overflows to the ring's next worker.
    hot = [
        prefill(w.worker_id, inflight=10 if w.worker_id == first.prefill_worker_id else 0)
        for w in workers
    ]
    moved = route(request(PROMPT, "alice"), WorkersView(hot, DECODE), CONFIG)
    assert moved.prefill_worker_id != first.prefill_worker_id
    assert moved.reason == REASON_SESSION_OVERFLOW


def test_sessions_spread_over_workers():
    workers = WorkersView([prefill(f"w{i}") for i in range(4)], DECODE)
    chosen = {route(request(PROMPT, f"s{i}"), workers, CONFIG).prefill_worker_id for i in range(64)}
    assert len(chosen) == 4


def test_conditional_disaggregation_threshold():
    workers = WorkersView([prefill("a", cached=HASHES[:14])], DECODE)  # 224 cached of 256
    d = route(request(PROMPT), workers, RoutingConfig(remote_prefill_min_tokens=33))
    assert (d.prefill_worker_id, d.reason) == (None, REASON_SHORT_PROMPT)
    d = route(request(PROMPT), workers, RoutingConfig(remote_prefill_min_tokens=32))
    assert d.prefill_worker_id == "a"
    short = list(range(1000, 1063))
    assert route(request(short), workers, CONFIG).reason == REASON_SHORT_PROMPT
    assert route(request(list(range(1000, 1064))), workers, CONFIG).prefill_worker_id == "a"


def test_a_decode_worker_busy_prefilling_sends_short_prompts_to_a_prefill_worker():
    """Below the threshold a prompt goes local only while its decode worker has less than two
    thresholds' worth of its own prefill queued; without prefill workers it goes local anyway."""
    short = request(list(range(1000, 1040)))  # 40 tokens
    for own, expected in [(0, None), (127, None), (128, "a"), (500, "a")]:
        decode = [DecodeView("d0", free_pages=1000, num_running=3, load_tokens=own)]
        d = route(short, WorkersView([prefill("a")], decode), CONFIG)
        assert d.prefill_worker_id == expected, own
    busy = [DecodeView("d0", free_pages=1000, num_running=3, load_tokens=500)]
    assert route(short, WorkersView([], busy), CONFIG).reason == REASON_NO_PREFILL


def test_without_prefill_workers_decode_prefills_locally():
    d = route(request(PROMPT), WorkersView([], DECODE), CONFIG)
    assert (d.prefill_worker_id, d.decode_worker_id, d.reason) == (None, "d0", REASON_NO_PREFILL)


def test_without_decode_workers_there_is_no_route():
    with pytest.raises(NoWorkerError):
        route(request(PROMPT), WorkersView([prefill("a")], []), CONFIG)


def test_migration_goes_to_a_decode_worker():
    d = route(request(PROMPT, decode_only=True), WorkersView([prefill("a")], DECODE), CONFIG)
    assert (d.prefill_worker_id, d.reason) == (None, REASON_MIGRATION)


def test_decode_choice_by_headroom_and_running():
    decode = [DecodeView("full", 10, 0), DecodeView("roomy", 900, 2), DecodeView("busy", 1000, 50)]
    d = route(request(PROMPT), WorkersView([], decode), CONFIG)
    assert d.decode_worker_id == "roomy"
    # Equal headroom: fewer running wins.
    decode = [DecodeView("x", 500, 3), DecodeView("y", 500, 1)]
    assert route(request(PROMPT), WorkersView([], decode), CONFIG).decode_worker_id == "y"
    # None has room: the best of them is still chosen rather than failing.
    decode = [DecodeView("x", 1, 3), DecodeView("y", 2, 3)]
    assert route(request(PROMPT), WorkersView([], decode), CONFIG).decode_worker_id == "y"


OVERFLOW = RoutingConfig(remote_prefill_min_tokens=64, local_prefill_overflow_tokens=1024)


@pytest.mark.parametrize(
    "queued, decode_own, expected",
    [
        (1023, 0, "a"),  # below the threshold: remote
        (1024, 0, None),  # at it, with an idle decode worker: local
        (4000, 256, "a"),  # the decode worker already prefills one of its own: remote
    ],
)
def test_overflow_prefills_on_the_decode_worker_only_past_the_queue_threshold(
    queued, decode_own, expected
):
    decode = [DecodeView("d0", free_pages=1000, num_running=3, load_tokens=decode_own)]
    workers = WorkersView([prefill("a", load=queued)], decode)
    d = route(request(PROMPT), workers, OVERFLOW)
    assert d.prefill_worker_id == expected
    assert d.reason == (REASON_OVERFLOW if expected is None else REASON_LOAD)


def test_overflow_is_off_by_default_and_spares_sessions():
    workers = WorkersView([prefill("a", load=50_000)], DECODE)
    assert route(request(PROMPT), workers, CONFIG).prefill_worker_id == "a"
    assert route(request(PROMPT, session="s"), workers, OVERFLOW).prefill_worker_id == "a"
