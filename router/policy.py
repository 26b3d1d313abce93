"""The routing policy: a pure function from a request and a snapshot of the workers to a Decision.

Nothing here touches a socket or a clock, so every rule is unit-tested with plain values.

Prefill worker (remote prefill)::

    cost(w) = uncached_tokens(w) + load_weight * load_tokens(w)

``uncached_tokens`` is the prompt minus the leading pages ``w`` already holds (exact, from its
cache events), each page weighed by where it holds it: 1 in its pool, ``host_hit_weight`` in
host memory and ``disk_hit_weight`` on disk below the pool (a restored page costs its copy, a
fraction of computing it: the weights are 1 minus that fraction, measured on the box by
``python -m benchmarks.kv_tier_weights``); ``load_tokens`` is its queued prefill tokens,
counting tokens dispatched but not yet reported by a heartbeat. The lowest cost wins; ties
break by load, then by worker id.

Before scoring, the imbalance guard drops every candidate whose load exceeds
``imbalance_factor * min_load + imbalance_slack_tokens`` (the least-loaded worker always stays), so
a popular prefix cannot turn its holder into a hot spot.

A request with a session id skips scoring: its worker is the first on a consistent-hash ring walk
whose in-flight count is within ``(1 + session_load_epsilon)`` times the mean (consistent hashing
with bounded loads), so a conversation returns to the worker holding its prefix until that
worker is overloaded, and then overflows to the ring's next worker.

Conditional disaggregation: when the best uncached suffix is shorter than
``remote_prefill_min_tokens`` (or no prefill worker is registered) the request goes straight to
a decode worker, which prefills it locally, unless that worker already has twice that many
prompt tokens of its own queued. Overflow: when ``local_prefill_overflow_tokens`` is
set, a request whose chosen prefill worker already has that many tokens queued is prefilled by
its decode worker instead, if that worker has no prefill of its own queued: it waits less there
than behind the queue, and each decode worker's running batch pays for at most one local
prefill at a time. Requests with a session id stay with their prefix.

Prefix fetch: a request prefilled on its decode worker (a short uncached suffix, or an
overflow) names the prefill worker holding the longest run of its leading pages, in its pool or
the KV tiers below it (``prefix_source``): the decode worker fetches those pages from it instead
of computing them, so a conversation returning with a short new turn computes only that turn.
Only between workers whose transfer backend serves such fetches (ZeroMQ), and never the page of
the prompt's last token, which is computed to sample the first token.

Decode worker::

    score(d) = free_pages(d) - running_weight_pages * running(d)

over the workers with room for the request (all of them if none has room); the highest score
wins, ties by fewer running, then by worker id.

LoRA adapters: a request under an adapter costs a worker more where the adapter is not in its
device's slots (it must be written there, perhaps displacing another adapter's requests, which
then wait): ``lora_miss_tokens`` more on a prefill worker's cost (half of it where the adapter
is in the worker's host memory, read from its folder otherwise), ``lora_miss_pages`` off a
decode worker's score (half where in host memory). Each worker reports what it holds in its
heartbeats, so the router weighs residency, not the traffic it sent.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.kv_layout import pages_for

# Decision reasons; each is a label value of pdserve_router_decisions_total.
REASON_PREFIX = "prefix_hit"
REASON_LOAD = "least_loaded"
REASON_IMBALANCE = "imbalance_guard"
REASON_SESSION = "session_affinity"
REASON_SESSION_OVERFLOW = "session_overflow"
REASON_SHORT_PROMPT = "local_prefill_short"
REASON_NO_PREFILL = "local_prefill_no_prefill_workers"
REASON_OVERFLOW = "local_prefill_overflow"
REASON_MIGRATION = "migration"
REASONS = (
    REASON_PREFIX,
    REASON_LOAD,
    REASON_IMBALANCE,
    REASON_SESSION,
    REASON_SESSION_OVERFLOW,
    REASON_SHORT_PROMPT,
    REASON_NO_PREFILL,
    REASON_OVERFLOW,
    REASON_MIGRATION,
)


class NoWorkerError(RuntimeError):
    """No decode worker can take the request (the HTTP edge answers 503)."""


# Measured defaults of RoutingConfig's tier weights (docs/kv-tiers.md).
HOST_HIT_WEIGHT = 0.99
DISK_HIT_WEIGHT = 0.97


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    remote_prefill_min_tokens: int = 64
    load_weight: float = 1.0  # cost of one queued prefill token relative to one uncached token
    imbalance_factor: float = 2.0
    imbalance_slack_tokens: int = 2048
    session_load_epsilon: float = 0.25
    session_vnodes: int = 64
    running_weight_pages: float = 4.0
    local_prefill_overflow_tokens: int | None = None  # None: never overflow to a decode worker
    lora_miss_tokens: float = 256.0  # a prefill worker without the adapter in a device slot
    lora_miss_pages: float = 16.0  # a decode worker without the adapter in a device slot
    # What a page held below a worker's pool saves against computing it, per tier (1 - restore
    # time / compute time, measured: benchmarks/kv_tier_weights.py; --kv-host-hit-weight,
    # --kv-disk-hit-weight). A 2-core AVX-512 box, SmolLM2-135M bf16: see docs/kv-tiers.md.
    host_hit_weight: float = HOST_HIT_WEIGHT
    disk_hit_weight: float = DISK_HIT_WEIGHT
    # A request prefilled on its decode worker fetches the leading pages a prefill worker holds
    # (--no-prefix-fetch: never), where it holds at least this many.
    prefix_fetch: bool = True
    prefix_fetch_min_pages: int = 1


@dataclass(frozen=True, slots=True)
class RequestView:
    num_prompt_tokens: int
    page_hashes: Sequence[int]  # the prompt's chained page hashes (page_size of the pool)
    page_size: int
    num_new_tokens_max: int = 0  # max_tokens: the decode worker's room check
    session_id: str | None = None
    decode_only: bool = False  # a migration: the tokens so far are prefilled on a decode worker
    lora_name: str | None = None  # the LoRA adapter it computes under; None: the base model


@dataclass(frozen=True, slots=True)
class AdaptersHeld:
    """The LoRA adapters a worker holds in its device's slots and in its host memory."""

    on_device: frozenset[str] = frozenset()
    on_host: frozenset[str] = frozenset()

    def miss(self, lora_name: str | None) -> float:
        """0 where ``lora_name`` (None: the base model) is in a slot, 0.5 in host memory, 1
        where it must be read from its folder."""
        if lora_name is None or lora_name in self.on_device:
            return 0.0
        return 0.5 if lora_name in self.on_host else 1.0


@dataclass(frozen=True, slots=True)
class PrefillView:
    worker_id: str
    load_tokens: int  # queued prefill tokens, dispatched-but-unreported included
    num_inflight: int  # requests dispatched and not finished
    cached_hashes: frozenset[int] | set[int] = field(default_factory=frozenset)
    adapters: AdaptersHeld = field(default_factory=AdaptersHeld)
    # Page hashes held below its pool (its KV tiers), where the pool no longer holds them.
    host_hashes: frozenset[int] | set[int] = field(default_factory=frozenset)
    disk_hashes: frozenset[int] | set[int] = field(default_factory=frozenset)
    lends_prefixes: bool = False  # serves decode workers' prefix fetches (a ZeroMQ sender)


@dataclass(frozen=True, slots=True)
class DecodeView:
    worker_id: str
    free_pages: int  # heartbeat's free pages minus pages reserved by later dispatches
    num_running: int  # running + waiting + dispatched-but-unreported
    load_tokens: int = 0  # its own queued prefill tokens (local prefills), as for PrefillView
    adapters: AdaptersHeld = field(default_factory=AdaptersHeld)
    fetches_prefixes: bool = False  # can fetch a prefix from a prefill worker (ZeroMQ)


@dataclass(frozen=True, slots=True)
class WorkersView:
    prefill: Sequence[PrefillView]
    decode: Sequence[DecodeView]


@dataclass(frozen=True, slots=True)
class Decision:
    decode_worker_id: str
    prefill_worker_id: str | None  # None: the decode worker prefills locally
    reason: str
    num_cached_tokens: int = 0  # expected prefix-cache hit on the chosen prefill worker
    # A local prefill's prefix fetch: the prefill worker holding the prompt's leading pages,
    # and how many of them to fetch (None, 0: none).
    prefix_worker_id: str | None = None
    prefix_pages: int = 0


def route(request: RequestView, workers: WorkersView, config: RoutingConfig) -> Decision:
    """Choose the pair for one request. Raises ``NoWorkerError`` without a decode worker."""
    decode = choose_decode(request, workers.decode, config)
    if request.decode_only:
        return Decision(decode, None, REASON_MIGRATION)
    if not workers.prefill:
        return Decision(decode, None, REASON_NO_PREFILL)
    overlaps = {w.worker_id: overlap_tokens(request, w, config) for w in workers.prefill}
    best_uncached = request.num_prompt_tokens - max(overlaps.values())
    if best_uncached < config.remote_prefill_min_tokens and not busy_prefilling(
        decode, workers, config
    ):
        return local_prefill(request, workers, decode, REASON_SHORT_PROMPT, config)
    if request.session_id is not None:
        worker, reason = session_worker(request.session_id, workers.prefill, config)
        return Decision(decode, worker, reason, overlaps[worker])
    worker, reason = choose_prefill(request, workers.prefill, overlaps, config)
    if overflows(worker, decode, workers, config):
        return local_prefill(request, workers, decode, REASON_OVERFLOW, config)
    return Decision(decode, worker, reason, overlaps[worker])


def local_prefill(
    request: RequestView, workers: WorkersView, decode_id: str, reason: str, config: RoutingConfig
) -> Decision:
    """A decision to prefill on ``decode_id``, with the prefix it should fetch, if any."""
    source = prefix_source(request, workers, decode_id, config)
    if source is None:
        return Decision(decode_id, None, reason)
    worker_id, num_pages = source
    return Decision(decode_id, None, reason, prefix_worker_id=worker_id, prefix_pages=num_pages)


def prefix_source(
    request: RequestView, workers: WorkersView, decode_id: str, config: RoutingConfig
) -> tuple[str, int] | None:
    """The prefill worker holding the longest run of the prompt's leading pages (in its pool
    or its tiers, each page alike: a fetched page costs its copy wherever it was), and how many
    to fetch, for a prompt prefilled on ``decode_id``; None where none holds
    ``prefix_fetch_min_pages`` or the workers cannot fetch. Ties break by load, then id."""
    decode = next(w for w in workers.decode if w.worker_id == decode_id)
    if not config.prefix_fetch or not decode.fetches_prefixes or request.lora_name is not None:
        return None
    # Never the page of the last prompt token: it is computed to sample the first token.
    limit = max(request.num_prompt_tokens - 1, 0) // request.page_size
    best: tuple[int, int, str] | None = None  # (-pages, load, worker id)
    for worker in workers.prefill:
        if not worker.lends_prefixes:
            continue
        held = held_pages(request.page_hashes[:limit], worker)
        if held >= max(config.prefix_fetch_min_pages, 1):
            key = (-held, worker.load_tokens, worker.worker_id)
            best = key if best is None or key < best else best
    return None if best is None else (best[2], -best[0])


def held_pages(page_hashes: Sequence[int], worker: PrefillView) -> int:
    """How many of ``page_hashes``, from the first, ``worker`` holds in any tier."""
    held = 0
    for page_hash in page_hashes:
        if not (
            page_hash in worker.cached_hashes
            or page_hash in worker.host_hashes
            or page_hash in worker.disk_hashes
        ):
            break
        held += 1
    return held


def busy_prefilling(decode_id: str, workers: WorkersView, config: RoutingConfig) -> bool:
    """Whether ``decode_id`` already has two short prompts' worth of its own prefill queued: a
    short prompt then goes to a prefill worker, so that a burst of them cannot pile up on one
    decode worker (whose steps take only so many prompt tokens beside its decodes) while the
    prefill workers idle. Two, not one: on a CPU a decode worker gets through 256 queued prompt
    tokens (16 a step) in about the time a prefill worker's queue and its own 256-token step take
    (W3's short chats, one run each: TTFT p99 1459 ms with one, 846 ms with two, 1071 ms with
    no bound)."""
    own = next(w.load_tokens for w in workers.decode if w.worker_id == decode_id)
    return own >= 2 * config.remote_prefill_min_tokens


def overflows(prefill_id: str, decode_id: str, workers: WorkersView, config: RoutingConfig) -> bool:
    """Whether the request should skip ``prefill_id``'s queue for a local prefill."""
    threshold = config.local_prefill_overflow_tokens
    if threshold is None:
        return False
    queued = next(w.load_tokens for w in workers.prefill if w.worker_id == prefill_id)
    own = next(w.load_tokens for w in workers.decode if w.worker_id == decode_id)
    return queued >= threshold and own == 0


def overlap_tokens(
    request: RequestView, worker: PrefillView, config: RoutingConfig | None = None
) -> int:
    """Tokens of the prompt's leading pages that ``worker`` holds (a chain stops at a miss),
    each page weighed by its tier (``config``'s weights; 1 in the pool)."""
    host_weight = config.host_hit_weight if config is not None else HOST_HIT_WEIGHT
    disk_weight = config.disk_hit_weight if config is not None else DISK_HIT_WEIGHT
    held = 0.0
    for page_hash in request.page_hashes:
        if page_hash in worker.cached_hashes:
            held += 1.0
        elif page_hash in worker.host_hashes:
            held += host_weight
        elif page_hash in worker.disk_hashes:
            held += disk_weight
        else:
            break
    # The last prompt token is always recomputed to sample the first token.
    return min(int(held * request.page_size), max(request.num_prompt_tokens - 1, 0))


def choose_prefill(
    request: RequestView,
    candidates: Sequence[PrefillView],
    overlaps: dict[str, int],
    config: RoutingConfig,
) -> tuple[str, str]:
    min_load = min(w.load_tokens for w in candidates)
    bound = config.imbalance_factor * min_load + config.imbalance_slack_tokens
    allowed = [w for w in candidates if w.load_tokens <= bound]

    def key(w: PrefillView) -> tuple[float, int, str]:
        cost = (
            request.num_prompt_tokens
            - overlaps[w.worker_id]
            + config.lora_miss_tokens * (w.adapters.miss(request.lora_name))
        )
        return (cost + config.load_weight * w.load_tokens, w.load_tokens, w.worker_id)

    chosen = min(allowed, key=key)
    unguarded = min(candidates, key=key)
    if unguarded.worker_id != chosen.worker_id:
        return chosen.worker_id, REASON_IMBALANCE
    return chosen.worker_id, REASON_PREFIX if overlaps[chosen.worker_id] > 0 else REASON_LOAD


def session_worker(
    session_id: str, candidates: Sequence[PrefillView], config: RoutingConfig
) -> tuple[str, str]:
    """Consistent hashing with bounded loads: the first ring worker within the load bound."""
    ring = _ring(tuple(sorted(w.worker_id for w in candidates)), config.session_vnodes)
    by_id = {w.worker_id: w for w in candidates}
    total = sum(w.num_inflight for w in candidates) + 1  # the request being placed counts
    bound = math.ceil((1 + config.session_load_epsilon) * total / len(candidates))
    start = bisect.bisect(ring[0], _hash64(session_id)) % len(ring[0])
    seen: list[str] = []
    for i in range(len(ring[0])):
        worker_id = ring[1][(start + i) % len(ring[0])]
        if worker_id in seen:
            continue
        seen.append(worker_id)
        if by_id[worker_id].num_inflight + 1 <= bound:
            reason = REASON_SESSION if len(seen) == 1 else REASON_SESSION_OVERFLOW
            return worker_id, reason
    # Unreachable: the least-loaded worker is always within the bound.
    return min(candidates, key=lambda w: (w.num_inflight, w.worker_id)).worker_id, REASON_LOAD


def choose_decode(
    request: RequestView, candidates: Sequence[DecodeView], config: RoutingConfig
) -> str:
    if not candidates:
        raise NoWorkerError("no decode worker is registered")
    needed = pages_for(request.num_prompt_tokens + request.num_new_tokens_max, request.page_size)
    fitting = [w for w in candidates if w.free_pages >= needed] or list(candidates)

    def key(w: DecodeView) -> tuple[float, int, str]:
        score = w.free_pages - config.running_weight_pages * w.num_running
        score -= config.lora_miss_pages * w.adapters.miss(request.lora_name)
        return (-score, w.num_running, w.worker_id)

    return min(fitting, key=key).worker_id


_RING_CACHE: dict[tuple[tuple[str, ...], int], tuple[list[int], list[str]]] = {}


def _ring(worker_ids: tuple[str, ...], vnodes: int) -> tuple[list[int], list[str]]:
    # Memoised on the membership: the ring changes only when a worker joins or leaves.
    key = (worker_ids, vnodes)
    ring = _RING_CACHE.get(key)
    if ring is None:
        points = sorted((_hash64(f"{w}#{i}"), w) for w in worker_ids for i in range(vnodes))
        ring = ([p for p, _ in points], [w for _, w in points])
        if len(_RING_CACHE) > 64:
            _RING_CACHE.clear()
        _RING_CACHE[key] = ring
    return ring


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
