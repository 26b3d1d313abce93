"""Messages between the router and the workers, and from a prefill worker to a decode worker.

Sockets (all ZeroMQ, every frame one message from ``common.messages``)::

    router  ROUTER bind  (--control)  ◀──DEALER──  every worker, identity = worker id
        worker -> router: RegisterWorker, Heartbeat, CacheEvents, TokenDelta(s), RequestFailed,
                          WorkerDraining, AdapterResult, RoleSwitchResult
        router -> worker: RegisterAck, PrefillRequest, DecodeRequest, AbortRequest, LeaveAck,
                          LoadAdapter, UnloadAdapter, SwitchRole
    decode  PULL   bind  (handoff)    ◀──PUSH────  prefill workers: HandoffPart, Handoff,
                                                   AbortRequest (withdraws shipped parts)

A request keeps the id the router gave it in every message. The first token of a disaggregated
request comes from the prefill worker (a ``TokenDelta`` with ``first=True``); the rest come from
the decode worker that received the handoff.

A worker that gets SIGTERM drains (``common/service/drain.py``): it sends ``WorkerDraining`` and
the router routes nothing new to it; it serves what it holds, then sends ``WorkerDraining`` with
``leaving`` and waits for the router's ``LeaveAck`` before it closes its sockets.

A worker changes role live (``common/service/role_switch.py``): the router routes nothing new
to it and sends ``SwitchRole``; the worker serves what it holds, then builds the other role
around the same engine (weights and KV pool kept), registers again under the same worker id
and incarnation with the new role, and answers ``RoleSwitchResult``. A switch refused or failed
leaves it serving in its old role, which the ``RoleSwitchResult`` names.

A prompt prefilled in several chunks may be shipped as it goes: after each chunk the prefill
worker publishes the prompt's newly completed pages and PUSHes a ``HandoffPart``, so the decode
worker fetches them while the next chunk computes; the ``Handoff`` then carries only the pages
after the parts. Parts and handoff travel on one socket, so they arrive in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_layout import KVLayout
from common.messages import Message, message
from common.sampling_params import SamplingParams

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
# RegisterAck.reason of a router that hears from a worker it does not know (it restarted, or
# dropped the worker as silent): the worker registers again and resends its prefix cache.
REREGISTER = "unknown worker; register again"
ROLES = (ROLE_PREFILL, ROLE_DECODE)
# The longest a role switch may take to drain a worker (an hour: longer is a mistake).
MAX_SWITCH_DRAIN_S = 3600.0
# RoleSwitchResult.outcome: the worker serves the new role now; it would not start the switch
# (it serves the role already, cannot serve the other one); it started and went back.
SWITCH_SWITCHED = "switched"
SWITCH_REFUSED = "refused"
SWITCH_FAILED = "failed"
SWITCH_OUTCOMES = (SWITCH_SWITCHED, SWITCH_REFUSED, SWITCH_FAILED)


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected {ROLE_PREFILL!r} or {ROLE_DECODE!r}")


@dataclass(slots=True)
class TokenSample:
    """One generated token and, when asked for, its logprob and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_token_ids: list[int] | None = None  # best first
    top_logprobs: list[float] | None = None  # parallel to top_token_ids


@dataclass(slots=True)
class PromptTokenLogprob:
    """A prompt token's logprob given the tokens before it, its rank in the vocabulary (1: the
    most likely) and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]  # best first
    top_logprobs: list[float]  # parallel to top_token_ids


@dataclass(slots=True, frozen=True)
class RankSender:
    """One rank of a tensor-parallel prefill worker: its sender's side channel, and the run of
    the model's KV heads its pages hold."""

    endpoint: str  # tcp://HOST:PORT
    engine_id: str
    first_kv_head: int
    num_kv_heads: int

    @property
    def heads(self) -> range:
        return range(self.first_kv_head, self.first_kv_head + self.num_kv_heads)


@dataclass(slots=True, frozen=True)
class PrefixSource:
    """A prefill worker holding the leading ``num_pages`` pages of a prompt (in its pool or in
    the KV tiers below it) that a decode worker prefilling the prompt may fetch instead of
    computing them (``kvtransfer/base.py``'s ``KVReceiver.start_prefix_fetch``)."""

    worker_id: str
    backend: str  # "zmq": the backend that serves prefix fetches
    endpoint: str  # the prefill worker's KV side channel, tcp://HOST:PORT
    num_pages: int

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"a prefix source offers at least one page, not {self.num_pages}")


@dataclass(slots=True)
class TransferParams:
    """How a decode worker fetches one transfer's pages (``kvtransfer/base.py``): the sender's
    part of a handoff, read by the decode worker's receiver."""

    backend: str  # "zmq" | "nixl"
    endpoint: str  # the sender's side channel, tcp://HOST:PORT
    engine_id: str  # the sender's identity; receivers cache handshakes under it
    page_ids: list[int]  # source pages, in context order
    lease_deadline: float  # time.time() until which the sender keeps the pages
    # A tensor-parallel prefill worker's ranks, rank 0 (``endpoint`` above, which holds the
    # lease) first: each published the same pages of its own pool under the same transfer id.
    # Empty: one process whose pages hold every KV head.
    ranks: list[RankSender] = field(default_factory=list)


@dataclass(slots=True)
class StageTimes:
    """Where a request's time went on one worker, in seconds (the router turns them into its
    latency histograms). Durations, not timestamps: the hosts' clocks need not agree. A field is
    None when the delta that carries it is not the one that ends that stage."""

    queue_s: float | None = None  # admitted by the scheduler -> first scheduled
    prefill_s: float | None = None  # first scheduled -> first token sampled
    handoff_s: float | None = None  # decode: prefill finished -> every page here (wall clocks)
    decode_queue_s: float | None = None  # decode: every page here -> first decode step


# -- worker -> router --------------------------------------------------------------------------


@message("worker.register")
@dataclass(slots=True)
class RegisterWorker(Message):
    protocol_version: int
    worker_id: str
    # Random per worker process: the same registration sent again (the worker re-sends until
    # acknowledged) is told apart from a restart under the same worker_id.
    incarnation: str
    role: str  # ROLE_PREFILL | ROLE_DECODE
    model: str  # the served model's name (its folder name)
    kv_layout: KVLayout
    kv_transfer: str  # "zmq" | "nixl"
    num_pages: int
    max_model_len: int
    metrics_url: str
    handoff_endpoint: str | None = None  # decode workers: where prefill workers PUSH handoffs
    # Prefill workers: their KV sender's side channel, where a decode worker fetches a prefix of
    # a prompt it prefills itself (``DecodeRequest.prefix``); None: it serves no such fetch.
    kv_endpoint: str | None = None
    # Batch-invariant kernels (--enable-deterministic-inference); a pool is all one or the other.
    deterministic: bool = False


@message("worker.heartbeat")
@dataclass(slots=True)
class Heartbeat(Message):
    worker_id: str
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens admitted but not yet computed
    num_free_pages: int
    kv_usage: float  # fraction of pages in use, 0..1
    # How the router tells slow from stuck (router/dispatcher.py's ``expire``): the steps this
    # worker has taken since it started, and every request it holds, each with a count that
    # grows as that request moves here (tokens computed and generated, pages received).
    num_steps: int = 0
    held_request_ids: list[str] = field(default_factory=list)
    held_progress: list[int] = field(default_factory=list)  # parallel to held_request_ids
    # How fast this worker clears its queue, for the router's admission: prompt tokens computed
    # per second of step (a moving average; 0 until measured), and requests finished per second.
    prefill_tokens_per_s: float = 0.0
    finished_per_s: float = 0.0
    # What its steps have cost since it started: wall time, tokens computed and rows, summed
    # over its steps (num_steps of them). Two heartbeats give the mean step of the span between,
    # which the planner fits its step cost to (planner/fit.py).
    busy_seconds: float = 0.0
    step_tokens: int = 0
    step_rows: int = 0
    # LoRA adapters (common/engine/lora.py): those this worker serves, those whose tensors it
    # holds in host memory, and those in its device's slots; the router routes by them.
    lora_adapters: list[str] = field(default_factory=list)
    loras_on_host: list[str] = field(default_factory=list)
    loras_on_device: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.held_request_ids) != len(self.held_progress):
            raise ValueError("held_request_ids and held_progress differ in length")


@message("worker.adapter_result")
@dataclass(slots=True)
class AdapterResult(Message):
    """A worker's answer to ``LoadAdapter`` or ``UnloadAdapter``: done, or why not."""

    worker_id: str
    operation_id: str
    error: str | None = None


@message("worker.role_switch_result")
@dataclass(slots=True)
class RoleSwitchResult(Message):
    """A worker's answer to ``SwitchRole``: ``outcome`` (``SWITCH_*``) and ``role``, the role it
    serves now (the new one once switched; the old one after a refusal or a failure, with
    ``error`` saying why). Sent after the new role's ``RegisterWorker``, on the same socket, so
    the router has re-registered the worker when it reads this."""

    worker_id: str
    operation_id: str
    role: str
    outcome: str
    error: str | None = None

    def __post_init__(self) -> None:
        check_role(self.role)
        if self.outcome not in SWITCH_OUTCOMES:
            raise ValueError(f"unknown role switch outcome {self.outcome!r}")
        if (self.outcome == SWITCH_SWITCHED) != (self.error is None):
            raise ValueError("a role switch result has an error exactly when it did not switch")


@message("worker.cache_events")
@dataclass(slots=True)
class CacheEvents(Message):
    """Prefix-cache page hashes filed and evicted, in order, since the last report, in one
    tier of the worker's KV cache."""

    worker_id: str
    stored: list[int]
    removed: list[int]
    # True when this report replaces everything the router knew of this worker's cache
    # (sent at registration, so a router that restarted rebuilds an exact index).
    reset: bool = False
    # Where the pages are: the pool (TIER_DEVICE), or a tier below it (TIER_HOST, TIER_DISK;
    # common/engine/kv_tiers/). A frame without it is of the pool, as before tiers.
    tier: str = "device"


TIER_DEVICE = "device"
TIER_HOST = "host"
TIER_DISK = "disk"
CACHE_TIERS = (TIER_DEVICE, TIER_HOST, TIER_DISK)


@message("worker.token_delta")
@dataclass(slots=True)
class TokenDelta(Message):
    request_id: str
    samples: list[TokenSample]
    # Output position of samples[0]: deltas of one request come from two workers (the first
    # token from the prefill worker, the rest from the decode worker), so the router orders
    # them by position rather than by arrival.
    start_index: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the request is done
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first: bool = False  # carries the request's first token (sent by the prefill worker)
    # With the first token, when the request asked: prompt tokens 1.. (token 0 has no context).
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    # With the first token a worker produces for the request: how long its stages took there.
    timings: StageTimes | None = None


@message("worker.token_deltas")
@dataclass(slots=True)
class TokenDeltas(Message):
    """Every delta of one engine step, in one frame: a step of a 32-sequence batch is one
    message to encode, send and decode instead of 32.

    The usual delta of a decode step, one token and nothing else to say (no logprob, no finish,
    not a request's first token here, no stage times), travels in three columns instead of as
    a ``TokenDelta``: a 64-sequence step is then three short lists to build, encode and decode
    rather than 64 nested maps. ``all_deltas`` gives back every delta."""

    deltas: list[TokenDelta] = field(default_factory=list)
    token_request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_start_indices: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.token_request_ids) == len(self.token_ids) == len(self.token_start_indices):
            raise ValueError(
                "token_request_ids, token_ids and token_start_indices differ in length"
            )

    def add_token(self, request_id: str, token_id: int, start_index: int) -> None:
        self.token_request_ids.append(request_id)
        self.token_ids.append(token_id)
        self.token_start_indices.append(start_index)

    def all_deltas(self) -> list[TokenDelta]:
        """Every delta of the frame, the columns' as ``TokenDelta``s."""
        columns = zip(self.token_request_ids, self.token_ids, self.token_start_indices, strict=True)
        return self.deltas + [
            TokenDelta(request_id, [TokenSample(token_id)], start_index)
            for request_id, token_id, start_index in columns
        ]


@message("worker.request_failed")
@dataclass(slots=True)
class RequestFailed(Message):
    """The worker gave up on a request; the router may re-dispatch it if ``retryable``."""

    request_id: str
    error: str
    retryable: bool


@message("worker.draining")
@dataclass(slots=True)
class WorkerDraining(Message):
    """The worker is shutting down: route nothing new to it. Requests already on their way are
    still served. Sent again every second while it drains, so a router that restarted meanwhile
    learns it too (a router that predates this message drops it as an unknown type, and finds
    the worker gone by its heartbeats instead).

    With ``leaving``, the worker is going now: whatever the router still has on it (the drain
    ran out of time, or a request crossed the first message) is moved elsewhere as when a
    worker dies, and the router answers ``LeaveAck``."""

    worker_id: str
    leaving: bool = False


# -- router -> worker --------------------------------------------------------------------------


@message("router.register_ack")
@dataclass(slots=True)
class RegisterAck(Message):
    accepted: bool
    reason: str | None = None
    heartbeat_interval: float = 1.0


@message("router.leave_ack")
@dataclass(slots=True)
class LeaveAck(Message):
    """The router has read everything the leaving worker sent before its ``WorkerDraining``
    (``leaving``), one socket keeping them in order, and has moved what it held: the worker may
    close its sockets without losing a token it sent."""

    worker_id: str


@message("router.prefill")
@dataclass(slots=True)
class PrefillRequest(Message):
    """Compute the prompt's KV, send the first token to the router and hand off to a decode
    worker at ``handoff_endpoint``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_worker_id: str
    handoff_endpoint: str
    lora_name: str | None = None  # the LoRA adapter it computes under; None: the base model


@message("router.decode")
@dataclass(slots=True)
class DecodeRequest(Message):
    """Serve a request end to end on a decode worker, prefilling locally: a short prompt
    (conditional disaggregation) or a migrated request, whose tokens generated so far are in
    ``output_token_ids`` and continue rather than restart."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    lora_name: str | None = None  # the LoRA adapter it computes under; None: the base model
    # A prefill worker holding the prompt's leading pages: fetched from it, they are not
    # computed here (a failed fetch only means they are).
    prefix: PrefixSource | None = None


@message("router.load_adapter")
@dataclass(slots=True)
class LoadAdapter(Message):
    """Serve LoRA adapter ``lora_name`` from ``lora_path`` (a runtime load); answered by an
    ``AdapterResult``. Loading a name already served from the same path is done already."""

    operation_id: str
    lora_name: str
    lora_path: str


@message("router.unload_adapter")
@dataclass(slots=True)
class UnloadAdapter(Message):
    """Stop serving LoRA adapter ``lora_name``; answered by an ``AdapterResult``, an error
    while a request this worker holds still computes under it."""

    operation_id: str
    lora_name: str


@message("router.switch_role")
@dataclass(slots=True)
class SwitchRole(Message):
    """Become a ``role`` worker: finish what this worker holds (the router routes it nothing
    new meanwhile) within ``drain_timeout_s``, then serve ``role`` with the same engine;
    answered by a ``RoleSwitchResult`` carrying ``operation_id``."""

    operation_id: str
    role: str
    drain_timeout_s: float

    def __post_init__(self) -> None:
        check_role(self.role)
        if not 0 < self.drain_timeout_s <= MAX_SWITCH_DRAIN_S:
            raise ValueError(
                f"drain_timeout_s must be in (0, {MAX_SWITCH_DRAIN_S:g}], "
                f"not {self.drain_timeout_s}"
            )


@message("router.abort")
@dataclass(slots=True)
class AbortRequest(Message):
    request_id: str


# -- prefill worker -> decode worker -----------------------------------------------------------


@message("prefill.handoff_part")
@dataclass(slots=True)
class HandoffPart(Message):
    """Leading pages of a prompt still being prefilled: prompt pages ``first_page`` onwards, as
    many as ``transfer`` offers, fetched under the transfer id ``transfer_id``
    (``<request id>/part<part_index>``). A ``Handoff``'s own pages go under the request id."""

    request_id: str
    part_index: int  # 0, 1, ... in the order parts are sent
    first_page: int  # index in the prompt's pages of the first page shipped
    num_prompt_tokens: int  # the decode worker reserves the whole prompt's pages at part 0
    transfer_id: str
    transfer: TransferParams


@message("prefill.handoff")
@dataclass(slots=True)
class Handoff(Message):
    """A prompt whose KV is ready on a prefill worker, with its first token sampled there."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: TokenSample
    transfer: TransferParams
    num_cached_tokens: int = 0
    # Wall-clock time (time.time()) the prefill worker finished the prompt's last chunk; None
    # when unknown. The decode worker measures the handoff from it.
    prefill_done_at: float | None = None
    # Pages before ``first_page`` came in ``num_parts`` HandoffParts; ``transfer`` offers the
    # rest. 0 and 0: it offers every page of the prompt.
    first_page: int = 0
    num_parts: int = 0
    # The LoRA adapter the KV was computed under (None: the base model) and its prefix-cache
    # namespace on the prefill worker (common/lora_adapters.py): the decode worker takes the
    # pages only where it holds the same adapter, the same weights.
    lora_name: str | None = None
    cache_namespace: str = ""
