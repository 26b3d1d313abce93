"""Prometheus metrics every worker exports, and the endpoint that serves them.

Counters are process-wide (prometheus_client's default registry): one worker per process.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PROMPT_TOKENS_COMPUTED = Counter(
    "pdserve_prompt_tokens_computed",
    "Prompt tokens this worker ran through the model itself (prefix-cache hits and shipped KV "
    "excluded)",
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from this worker's prefix cache"
)
GENERATED_TOKENS = Counter("pdserve_generated_tokens", "Tokens sampled by this worker")
REQUESTS = Counter("pdserve_requests", "Requests this worker finished, by outcome", ["outcome"])
GRAMMAR_COMPILES = Counter(
    "pdserve_grammar_compiles",
    "Structured-output grammars compiled, by the library that compiled them (none: neither could)",
    ["backend"],
)
GRAMMAR_CACHE_HITS = Counter(
    "pdserve_grammar_cache_hits", "Structured-output specs whose grammar was compiled already"
)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "pdserve_grammar_compile_seconds",
    "Time to compile a structured-output grammar, off the step thread, by library",
    ["backend"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10),
)
GRAMMAR_MASK_SECONDS = Histogram(
    "pdserve_grammar_mask_seconds",
    "Time a step spent filling the token masks of its rows under a grammar",
    buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1),
)
BAD_MESSAGES = Counter(
    "pdserve_bad_messages",
    "Frames dropped as malformed, oversized, unknown or unexpected, by socket",
    ["socket"],
)
KV_PAGES_SENT = Counter(
    "pdserve_kv_pages_sent",
    "KV pages handed off to decode workers (handoff delivered to the socket; fetch failures "
    "are counted by pdserve_kv_transfer_failures)",
)
KV_PAGES_RECEIVED = Counter("pdserve_kv_pages_received", "KV pages received from prefill workers")
KV_HANDOFF_SECONDS = Histogram(
    "pdserve_kv_handoff_seconds",
    "Decode: from the prefill worker finishing a prompt's last chunk to every page of it held "
    "here (the handoff message, the wait for this worker's loop, the transfer). Measured "
    "between the two hosts' wall clocks, so across hosts it includes their offset",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
KV_TRANSFER_FALLBACKS = Counter(
    "pdserve_kv_transfer_fallbacks",
    "Handoffs whose pages could not be fetched, so the prompt was prefilled locally",
)
SPEC_PROPOSED = Counter(
    "pdserve_spec_decode_proposed_tokens", "Speculative tokens proposed for verification"
)
SPEC_ACCEPTED = Counter(
    "pdserve_spec_decode_accepted_tokens", "Speculative tokens the target model accepted"
)
STEPS_LAUNCHED_AHEAD = Counter(
    "pdserve_steps_launched_ahead",
    "Decode steps launched before the previous step's tokens were read (--async-scheduling)",
)
SPEC_ACCEPTED_PER_STEP = Histogram(
    "pdserve_spec_decode_accepted_tokens_per_step",
    "Proposed tokens accepted per speculating sequence per step",
    buckets=tuple(range(16)),
)
AUTH_FAILURES = Counter(
    "pdserve_auth_failures",
    "Connections refused on an internal socket: the peer did not prove the cluster secret",
    ["socket"],
)
# Names and bucket edges follow vLLM's where it has the same quantity (vllm:num_requests_running
# is pdserve_num_requests_running): its users' dashboards and alerts carry over.
RUNNING = Gauge("pdserve_num_requests_running", "Requests in the running batch")
WAITING = Gauge(
    "pdserve_num_requests_waiting",
    "Requests waiting to be scheduled (decode: and those waiting for their KV pages)",
)
KV_USAGE = Gauge("pdserve_kv_cache_usage_perc", "Fraction of KV pages in use, 0 to 1")
# What a prefill pool's autoscaler reads (deploy/kubernetes): the queue in prompt tokens, which
# is what a new prompt waits behind, where a count of requests says little.
PROMPT_TOKENS_QUEUED = Gauge(
    "pdserve_num_prompt_tokens_queued", "Prompt tokens admitted here but not yet computed"
)
NUM_PREEMPTIONS = Counter(
    "pdserve_num_preemptions", "Sequences preempted (their KV freed, recomputed later)"
)
KV_PAGES_RELEASED = Counter(
    "pdserve_kv_pages_released",
    "KV pages running sequences gave back to the pool, every position in them behind every "
    "layer's sliding window",
)
# The KV tiers below the pool (common/engine/kv_tiers/): ``tier`` is host or disk.
KV_TIER_HITS = Counter(
    "pdserve_kv_tier_hits", "KV pages restored into the pool from a tier below it", ["tier"]
)
KV_TIER_MISSES = Counter(
    "pdserve_kv_tier_misses",
    "Lookups below the pool (at admission, again each step a sequence waits at the head of "
    "the queue) whose next page a tier lacked, or held damaged",
    ["tier"],
)
KV_TIER_BYTES = Counter(
    "pdserve_kv_tier_bytes",
    "Bytes moved between the pool and a tier, by tier and direction (offload, restore)",
    ["tier", "direction"],
)
KV_TIER_RESTORE_SECONDS = Histogram(
    "pdserve_kv_tier_restore_seconds",
    "One sequence's restore of pages from the tiers, on the mover thread",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
KV_TIER_EVICTIONS = Counter(
    "pdserve_kv_tier_evictions", "KV pages a tier dropped to make room", ["tier"]
)
KV_TIER_REJECTED = Counter(
    "pdserve_kv_tier_disk_rejected",
    "Disk blocks read as a miss, by reason (missing, truncated, damaged, other weights or "
    "format, other page, other version)",
    ["reason"],
)
KV_TIER_DROPPED_WRITES = Counter(
    "pdserve_kv_tier_dropped_writes",
    "KV pages not written to the disk tier because its writes were too far behind",
)
# Prefix fetches (a decode worker prefilling a prompt fetches its leading pages from a prefill
# worker): ``tier`` is where the prefill worker held a page (pool, host or disk).
KV_PREFIX_PAGES_FETCHED = Counter(
    "pdserve_kv_prefix_fetched_pages",
    "Decode: prompt pages fetched from a prefill worker instead of computed, by the tier "
    "it held them in",
    ["tier"],
)
KV_PREFIX_BYTES_FETCHED = Counter(
    "pdserve_kv_prefix_fetched_bytes",
    "Decode: bytes of the prompt pages fetched from a prefill worker, by the tier it held them in",
    ["tier"],
)
KV_PREFIX_FETCH_FALLBACKS = Counter(
    "pdserve_kv_prefix_fetch_fallbacks",
    "Decode: prefix fetches that brought nothing usable, so the prompt was computed here, by "
    "reason",
    ["reason"],
)
KV_PREFIX_PAGES_LENT = Counter(
    "pdserve_kv_prefix_lent_pages",
    "Prefill: pages lent to a decode worker's prefix fetch, by the tier they were in",
    ["tier"],
)
STEP_SECONDS = Histogram(
    "pdserve_step_seconds",
    "One engine step: schedule, forward, sample, postprocess",
    buckets=(
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
        2.5, 5.0, 10.0, 20.0,
    ),
)  # fmt: skip
STEP_BATCH_SIZE = Histogram(
    "pdserve_step_batch_size",
    "Sequences in one engine step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
ITERATION_TOKENS = Histogram(
    "pdserve_iteration_tokens_total",
    "Tokens one engine step ran through the model (prompt chunks, decodes, speculative rows)",
    buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
)


def parse_exposition(text: str) -> dict[str, float]:
    """Samples of a /metrics page by their full name, labels included as written
    (``pdserve_x_total``, ``pdserve_y_count{backend="zmq",side="receiver"}``)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
