"""Request latencies and token counts as vLLM names them (under ``pdserve_``), and SLO goodput.

The dispatcher reports each sequence's life: its dispatch, its first token (with the stage times
of the worker that prefilled it), every later run of tokens, the decode worker's stage times
after a handoff, and its end. Where vLLM exports the same quantity this module uses vLLM's
meaning and bucket edges, so dashboards and alerts written for ``vllm:`` carry over by renaming
the prefix (docs/metrics.md lists the mapping). What a disaggregated request adds, the split of its
time to first token over the router, the prefill worker and the hops between, and the decode
worker's handoff wait and queue, has histograms of its own.

Counts are per sequence: a request with ``n`` choices is ``n`` sequences of one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.protocol import StageTimes

# vLLM's bucket edges (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM stops its 1-2-5 series at the model's length; the router serves any length, so the series
# runs to a million tokens (the same edges up to any model's length).
REQUEST_TOKENS_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# How a sequence ended (vLLM's finished_reason values).
FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class ServiceLevel:
    """Latency objectives a finished request must meet to count as goodput; None: no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return (self.ttft_s is None or ttft_s <= self.ttft_s) and (
            self.tpot_s is None or tpot_s <= self.tpot_s
        )


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry, slo: ServiceLevel) -> None:
        self.slo = slo
        r = registry

        def latency(name: str, doc: str, buckets=REQUEST_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = latency(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the router to its first token there",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = latency(
            "pdserve_inter_token_latency_seconds",
            "Time between a sequence's successive token deliveries at the router",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = latency(
            "pdserve_request_time_per_output_token_seconds",
            "Per finished sequence: first token to last, over the tokens after the first",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = latency(
            "pdserve_e2e_request_latency_seconds", "Per finished sequence: arrival to last token"
        )
        self.queue = latency(
            "pdserve_request_queue_time_seconds",
            "Arrival at the router to the prompt's first scheduled step: router queue plus "
            "prefill queue",
        )
        self.router_queue = latency(
            "pdserve_request_router_queue_time_seconds",
            "Arrival at the router to dispatch: parsing, tokenizing, routing",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.prefill_queue = latency(
            "pdserve_request_prefill_queue_time_seconds",
            "On the worker that prefills: admitted to first scheduled",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.prefill = latency(
            "pdserve_request_prefill_time_seconds",
            "On the worker that prefills: first scheduled to first token sampled",
        )
        self.first_token_hop = latency(
            "pdserve_request_first_token_hop_seconds",
            "Time to first token outside the router and the prefilling worker's scheduler: the "
            "request's trip to the worker and the first token's trip back",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.handoff_wait = latency(
            "pdserve_request_handoff_wait_seconds",
            "Decode worker: prefill finished to every page of the prompt held there (handoff "
            "message, transfer); across hosts it includes their clocks' offset",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.decode_queue = latency(
            "pdserve_request_decode_queue_time_seconds",
            "Decode worker: every page held to the sequence's first decode step",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.decode = latency(
            "pdserve_request_decode_time_seconds",
            "Per finished sequence: first token to last token at the router",
        )
        self.inference = latency(
            "pdserve_request_inference_time_seconds",
            "Per finished sequence: prefill time plus decode time",
        )
        self.prompt_tokens_hist = Histogram(
            "pdserve_request_prompt_tokens",
            "Prompt length per sequence",
            buckets=REQUEST_TOKENS_BUCKETS,
            registry=r,
        )
        self.generation_tokens_hist = Histogram(
            "pdserve_request_generation_tokens",
            "Generated tokens per finished sequence",
            buckets=REQUEST_TOKENS_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of sequences that got a first token", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pdserve_prompt_tokens_cached",
            "Of those, tokens served from a worker's prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens delivered to the router", registry=r
        )
        self.success = Counter(
            "pdserve_request_success",
            "Sequences that ended, by how (stop, length, abort, error)",
            ["finished_reason"],
            registry=r,
        )
        self.goodput = Counter(
            "pdserve_request_goodput",
            "Sequences that finished (stop or length) within --slo-ttft-ms and --slo-tpot-ms; "
            "rate() of it is the goodput",
            registry=r,
        )
        for name, bound in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
            if bound is not None:
                gauge = Gauge(
                    f"pdserve_slo_{name}_seconds",
                    f"The router's {name.upper()} objective (--slo-{name}-ms), for alert rules",
                    registry=r,
                )
                gauge.set(bound)
        self._success = {reason: self.success.labels(reason) for reason in FINISHED_REASONS}

    def dispatched(self, router_queue_s: float) -> None:
        self.router_queue.observe(router_queue_s)

    def first_token(
        self,
        ttft_s: float,
        router_queue_s: float,
        since_dispatch_s: float,
        times: StageTimes | None,
        num_prompt_tokens: int,
        num_cached_tokens: int,
    ) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        self.prompt_tokens_hist.observe(num_prompt_tokens)
        if times is None or times.queue_s is None or times.prefill_s is None:
            return
        self.prefill_queue.observe(times.queue_s)
        self.queue.observe(router_queue_s + times.queue_s)
        self.prefill.observe(times.prefill_s)
        self.first_token_hop.observe(max(0.0, since_dispatch_s - times.queue_s - times.prefill_s))

    def decode_stages(self, times: StageTimes) -> None:
        if times.handoff_s is not None:
            self.handoff_wait.observe(times.handoff_s)
        if times.decode_queue_s is not None:
            self.decode_queue.observe(times.decode_queue_s)

    def tokens(self, num_new: int, since_last_s: float | None) -> None:
        self.generation_tokens.inc(num_new)
        if since_last_s is not None:
            self.itl.observe(since_last_s)

    def ended(
        self,
        reason: str,
        e2e_s: float,
        ttft_s: float | None,
        decode_s: float,
        num_generated: int,
        prefill_s: float | None,
    ) -> None:
        """A sequence ended; latencies are recorded for those that finished (stop, length)."""
        self._success[reason].inc()
        if reason not in ("stop", "length") or ttft_s is None:
            return
        tpot_s = decode_s / (num_generated - 1) if num_generated > 1 else 0.0
        self.e2e.observe(e2e_s)
        self.decode.observe(decode_s)
        if num_generated > 1:
            self.tpot.observe(tpot_s)
        if prefill_s is not None:
            self.inference.observe(prefill_s + decode_s)
        self.generation_tokens_hist.observe(num_generated)
        if self.slo.met(ttft_s, tpot_s):
            self.goodput.inc()
