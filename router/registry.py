"""The router's book of workers: who is registered, how loaded, and which prefix pages each holds.

No sockets and no clock of its own: the control loop passes ``now`` in, so tests drive time.

Load accounting counts a request the moment it is dispatched (``on_dispatch``), weighted by its
uncached prompt tokens. Those tokens stay counted until the request's first token arrives or
until a heartbeat that the worker sent a full interval after the dispatch has arrived (it then
reports them in ``queued_prefill_tokens`` itself); overlap for up to one interval errs towards
seeing a worker as busier, never as idler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages import PROTOCOL_VERSION
from common.protocol import (
    ROLE_DECODE,
    ROLE_PREFILL,
    TIER_DEVICE,
    TIER_DISK,
    TIER_HOST,
    CacheEvents,
    Heartbeat,
    RegisterWorker,
)
from router.policy import AdaptersHeld, DecodeView, PrefillView, WorkersView

# The KV transfer backends that serve prefix fetches (kvtransfer/base.py): NIXL does not, so no
# fetch is asked of or by a worker on it.
PREFIX_FETCH_BACKENDS = ("zmq",)


@dataclass(slots=True)
class _Dispatch:
    prefill_tokens: int
    pages: int
    at: float


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    incarnation: str  # the worker process's, from its registration
    role: str
    model: str
    page_size: int
    num_pages: int
    max_model_len: int
    metrics_url: str
    kv_transfer: str
    handoff_endpoint: str | None
    deterministic: bool
    registered_at: float
    last_seen: float
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_free_pages: int = 0
    kv_usage: float = 0.0
    last_heartbeat_at: float | None = None
    # Its steps so far, and whether the latest heartbeat showed more than the one before: a
    # worker that heartbeats without stepping is stuck, not slow (the dispatcher's ``expire``).
    num_steps: int = 0
    stepped: bool = False
    prefill_tokens_per_s: float = 0.0
    finished_per_s: float = 0.0
    # Its steps' wall time, tokens and rows summed since it started (its latest heartbeat's).
    busy_seconds: float = 0.0
    step_tokens: int = 0
    step_rows: int = 0
    # A prefill worker's KV side channel, where decode workers fetch prefixes (None: none).
    kv_endpoint: str | None = None
    # Shutting down (WorkerDraining): it serves what it has, and nothing new is routed to it.
    draining: bool = False
    # Changing role (router/role_switch.py): the role it becomes and since when (the router's
    # clock); nothing new is routed to it meanwhile. None when not switching.
    switching_to: str | None = None
    switching_since: float | None = None
    # The outcome of its latest role switch, as ``GET /v1/workers`` shows it (None: none yet).
    last_role_switch: dict | None = None
    # request id -> what its dispatch added before a heartbeat could report it
    unreported: dict[str, _Dispatch] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)  # request ids this worker holds
    # LoRA adapters it serves, holds in host memory and in device slots (its heartbeats).
    lora_adapters: list[str] = field(default_factory=list)
    loras_on_host: list[str] = field(default_factory=list)
    loras_on_device: list[str] = field(default_factory=list)
    adapters_held: AdaptersHeld = field(default_factory=AdaptersHeld)  # the two above, for routing

    @property
    def serving(self) -> bool:
        """Whether new requests may be routed to it: neither draining nor changing role."""
        return not self.draining and self.switching_to is None

    @property
    def load_tokens(self) -> int:
        return self.queued_prefill_tokens + sum(d.prefill_tokens for d in self.unreported.values())

    @property
    def free_pages_estimate(self) -> int:
        return self.num_free_pages - sum(d.pages for d in self.unreported.values())

    @property
    def running_estimate(self) -> int:
        return max(self.num_running + self.num_waiting, 0) + len(self.unreported)

    def describe(self) -> dict:
        """The ``GET /v1/workers`` entry."""
        return {
            "id": self.worker_id,
            "role": self.role,
            "model": self.model,
            "endpoint": self.handoff_endpoint,
            "kv_transfer": self.kv_transfer,
            "metrics_url": self.metrics_url,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "max_model_len": self.max_model_len,
            "deterministic_inference": self.deterministic,
            "draining": self.draining,
            "switching": (None if self.switching_to is None else {"to": self.switching_to}),
            "last_role_switch": self.last_role_switch,
            "load": {
                "num_running": self.num_running,
                "num_waiting": self.num_waiting,
                "queued_prefill_tokens": self.queued_prefill_tokens,
                "dispatched_unreported": len(self.unreported),
                "inflight": len(self.inflight),
            },
            "kv_usage": self.kv_usage,
            "num_free_pages": self.num_free_pages,
            # Summed over its steps since it started: what the planner fits step costs to.
            "steps": {
                "count": self.num_steps,
                "busy_seconds": self.busy_seconds,
                "tokens": self.step_tokens,
                "rows": self.step_rows,
            },
            "lora_adapters": {
                "served": self.lora_adapters,
                "on_host": self.loras_on_host,
                "on_device": self.loras_on_device,
            },
        }


class WorkerRegistry:
    """Registration, heartbeats, the exact prefix index and load accounting.

    Called only from the router's event loop; no method pages. ``register`` returns the refusal
    reason (None when accepted); the other ``on_*`` methods ignore messages from unknown workers.
    """

    def __init__(self, model: str, heartbeat_timeout: float, page_size: int | None = None):
        self.model = model
        self.heartbeat_timeout = heartbeat_timeout
        self.page_size = page_size  # fixed by the first worker; every later one must match
        self.workers: dict[str, WorkerState] = {}
        # Exact prefix index: prefill worker -> page hashes it holds in its pool, and in each
        # tier below the pool (a page the pool evicted stays a prefix while a tier holds it).
        self._held: dict[str, set[int]] = {}
        self._held_below: dict[str, dict[str, set[int]]] = {}

    @property
    def deterministic(self) -> bool | None:
        """Whether the registered workers run batch-invariant kernels (they all agree; see
        ``register``); None while none is registered."""
        return next((w.deterministic for w in self.workers.values()), None)

    # -- membership ----------------------------------------------------------------------------

    def register(self, msg: RegisterWorker, now: float) -> str | None:
        if msg.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version {msg.protocol_version} does not match the router's "
                f"{PROTOCOL_VERSION}"
            )
        if msg.model != self.model:
            return f"model {msg.model!r} does not match the router's {self.model!r}"
        if msg.role not in (ROLE_PREFILL, ROLE_DECODE):
            return f"unknown role {msg.role!r}; expected {ROLE_PREFILL!r} or {ROLE_DECODE!r}"
        layout_problem = msg.kv_layout.problem()
        if layout_problem is not None:
            return layout_problem
        page_size = msg.kv_layout.page_size
        if self.page_size is not None and page_size != self.page_size:
            return f"page_size {page_size} does not match the pool's {self.page_size}"
        # One worker without batch-invariant kernels among workers with them would make a
        # request's answer depend on where it went.
        others = {w.deterministic for w in self.workers.values() if w.worker_id != msg.worker_id}
        if others and others != {msg.deterministic}:
            return (
                f"deterministic inference is {'on' if msg.deterministic else 'off'} on this "
                f"worker and {'off' if msg.deterministic else 'on'} on the registered ones"
            )
        if msg.role == ROLE_DECODE and not msg.handoff_endpoint:
            return "a decode worker must give its handoff_endpoint"
        if msg.worker_id in self.workers:
            # A restarted worker re-registers under its id: its old cache and load are gone.
            self.remove(msg.worker_id)
        self.page_size = page_size
        self.workers[msg.worker_id] = WorkerState(
            worker_id=msg.worker_id,
            incarnation=msg.incarnation,
            role=msg.role,
            model=msg.model,
            page_size=page_size,
            num_pages=msg.num_pages,
            max_model_len=msg.max_model_len,
            metrics_url=msg.metrics_url,
            kv_transfer=msg.kv_transfer,
            handoff_endpoint=msg.handoff_endpoint,
            deterministic=msg.deterministic,
            registered_at=now,
            kv_endpoint=msg.kv_endpoint if msg.role == ROLE_PREFILL else None,
            last_seen=now,
            num_free_pages=msg.num_pages,
        )
        self._held[msg.worker_id] = set()
        self._held_below[msg.worker_id] = {TIER_HOST: set(), TIER_DISK: set()}
        return None

    def change_role(self, msg: RegisterWorker, now: float) -> str | None:
        """The worker changed role in place (the same process: ``msg`` has its incarnation) and
        registers under its new one: its state starts afresh as for a new worker, but nothing
        it had is moved (it served all of it before switching; what the books still list on it
        are prefills whose decodes go on elsewhere). Its prefix index starts empty until its
        cache report. Returns the refusal reason, as ``register`` does."""
        known = self.workers.get(msg.worker_id)
        last = known.last_role_switch if known is not None else None
        reason = self.register(msg, now)  # checks, then replaces the old state
        if reason is None:
            self.workers[msg.worker_id].last_role_switch = last
        return reason

    def remove(self, worker_id: str) -> WorkerState | None:
        """Take a worker out; returns its state (its ``inflight`` requests need a new home)."""
        state = self.workers.pop(worker_id, None)
        self._held.pop(worker_id, None)
        self._held_below.pop(worker_id, None)
        return state

    def expired(self, now: float) -> list[str]:
        return [
            w.worker_id for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout
        ]

    def touch(self, worker_id: str, now: float) -> None:
        state = self.workers.get(worker_id)
        if state is not None:
            state.last_seen = now

    # -- reports -------------------------------------------------------------------------------

    def on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        state = self.workers.get(msg.worker_id)
        if state is None:
            return
        previous = state.last_heartbeat_at
        state.last_seen = now
        state.last_heartbeat_at = now
        state.num_running = msg.num_running
        state.num_waiting = msg.num_waiting
        state.queued_prefill_tokens = msg.queued_prefill_tokens
        state.num_free_pages = msg.num_free_pages
        state.kv_usage = msg.kv_usage
        state.stepped = msg.num_steps != state.num_steps
        state.num_steps = msg.num_steps
        state.prefill_tokens_per_s = msg.prefill_tokens_per_s
        state.finished_per_s = msg.finished_per_s
        state.busy_seconds = msg.busy_seconds
        state.step_tokens = msg.step_tokens
        state.step_rows = msg.step_rows
        state.lora_adapters = msg.lora_adapters
        if (msg.loras_on_host, msg.loras_on_device) != (state.loras_on_host, state.loras_on_device):
            state.loras_on_host = msg.loras_on_host
            state.loras_on_device = msg.loras_on_device
            state.adapters_held = AdaptersHeld(
                frozenset(msg.loras_on_device), frozenset(msg.loras_on_host)
            )
        if previous is not None:
            # Dispatched before the previous heartbeat arrived: this one has surely counted it.
            stale = [rid for rid, d in state.unreported.items() if d.at <= previous]
            for rid in stale:
                del state.unreported[rid]

    def on_cache_events(self, msg: CacheEvents, now: float) -> None:
        state = self.workers.get(msg.worker_id)
        if state is None:
            return
        state.last_seen = now
        if state.role != ROLE_PREFILL:
            return  # only prefill workers are chosen by prefix
        if msg.tier == TIER_DEVICE:
            held = self._held[msg.worker_id]
        elif msg.tier in (TIER_HOST, TIER_DISK):
            held = self._held_below[msg.worker_id][msg.tier]
        else:
            return  # a tier this router does not know: its pages are not counted
        if msg.reset:
            held.clear()
        held.update(msg.stored)
        held.difference_update(msg.removed)

    def on_draining(self, worker_id: str, now: float) -> bool:
        """The worker is shutting down: keep it (its requests still report here) but route
        nothing new to it. Whether this is news."""
        state = self.workers.get(worker_id)
        if state is None:
            return False
        state.last_seen = now
        news = not state.draining
        state.draining = True
        return news

    def cached_hashes(self, worker_id: str, tier: str = TIER_DEVICE) -> set[int]:
        if tier == TIER_DEVICE:
            return self._held.get(worker_id, set())
        return self._held_below.get(worker_id, {}).get(tier, set())

    # -- load accounting -----------------------------------------------------------------------

    def on_dispatch(
        self, worker_id: str, request_id: str, prefill_tokens: int, pages: int, now: float
    ) -> None:
        state = self.workers.get(worker_id)
        if state is None:
            return
        state.inflight.add(request_id)
        state.unreported[request_id] = _Dispatch(prefill_tokens, pages, now)

    def on_prefilled(self, worker_id: str, request_id: str) -> None:
        """The request's prompt has been computed there (its first token arrived)."""
        state = self.workers.get(worker_id)
        if state is not None:
            dispatch = state.unreported.get(request_id)
            if dispatch is not None:
                dispatch.prefill_tokens = 0

    def on_released(self, worker_id: str, request_id: str) -> None:
        state = self.workers.get(worker_id)
        if state is not None:
            state.inflight.discard(request_id)
            state.unreported.pop(request_id, None)

    # -- the policy's snapshot -----------------------------------------------------------------

    def view(self, exclude: frozenset[str] = frozenset()) -> WorkersView:
        prefill = []
        decode = []
        for w in self.workers.values():
            if w.worker_id in exclude or not w.serving:
                continue
            if w.role == ROLE_PREFILL:
                prefill.append(
                    PrefillView(
                        w.worker_id,
                        w.load_tokens,
                        len(w.inflight),
                        self._held[w.worker_id],
                        w.adapters_held,
                        self._held_below[w.worker_id][TIER_HOST],
                        self._held_below[w.worker_id][TIER_DISK],
                        lends_prefixes=w.kv_endpoint is not None
                        and w.kv_transfer in PREFIX_FETCH_BACKENDS,
                    )
                )
            else:
                decode.append(
                    DecodeView(
                        w.worker_id,
                        w.free_pages_estimate,
                        w.running_estimate,
                        w.load_tokens,
                        w.adapters_held,
                        fetches_prefixes=w.kv_transfer in PREFIX_FETCH_BACKENDS,
                    )
                )
        return WorkersView(prefill, decode)

    def pool(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]
