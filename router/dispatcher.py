"""In-flight sequences: dispatch, ordered token collection, re-dispatch, migration and abort.

Runs on the router's event loop; every method is synchronous and sends through ``send`` (the
control socket), so this class can be driven in tests without sockets. One ``Generation`` is one
sequence (one choice of one prompt); the HTTP handler owning it reads its tokens from ``sink``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.hashing import page_hashes
from common.kv_layout import pages_for
from common.messages import Message
from common.protocol import (
    REREGISTER,
    ROLE_DECODE,
    AbortRequest,
    AdapterResult,
    CacheEvents,
    DecodeRequest,
    Heartbeat,
    LeaveAck,
    PrefillRequest,
    PrefixSource,
    PromptTokenLogprob,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RoleSwitchResult,
    TokenDelta,
    TokenDeltas,
    TokenSample,
    WorkerDraining,
)
from common.sampling_params import SamplingParams
from router.admission import AdmissionConfig, Overloaded, WaitingQueue, is_full, predicted_wait_s
from router.metrics import RouterMetrics
from router.policy import (
    REASON_NO_PREFILL,
    Decision,
    NoWorkerError,
    RequestView,
    RoutingConfig,
    route,
)
from router.registry import WorkerRegistry
from router.traffic import Finished

logger = logging.getLogger(__name__)

# Page size used for prompt hashing before any worker has registered (no routing happens then).
_FALLBACK_PAGE_SIZE = 16


@dataclass(eq=False, slots=True)
class Generation:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue[int]  # receives ``index`` whenever this sequence changes
    index: int
    session_id: str | None = None
    arrived_at: float = 0.0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the output so far
    # The output's samples with their logprobs, parallel to token_ids, where the request asked for
    # logprobs; None otherwise: a plain token is kept as its id alone, as the workers send it.
    scored: list[TokenSample] | None = None
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # with the first token, if asked
    early: dict[int, TokenDelta] = field(default_factory=dict)  # deltas ahead of a gap
    held_progress: int = -1  # how far its worker last said it had come (-1: not said yet)
    queued: bool = False  # waiting in the router's queue for a worker with room
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 503
    num_cached_tokens: int = 0
    retries: int = 0
    finished_at: float | None = None
    # When it last moved: dispatched, a token, or a heartbeat of its worker that listed it and
    # showed it or its worker further on (``Dispatcher.expire``).
    progressed_at: float = 0.0
    # time.monotonic() of its latest dispatch, first token and latest token; the prefilling
    # worker's compute time (all for the latency metrics).
    dispatched_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prefill_s: float | None = None
    # The LoRA adapter it computes under (None: the base model) and the namespace its prompt's
    # pages are hashed in (common/lora_adapters.py).
    lora_name: str | None = None
    cache_namespace: str = ""

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.scored = []

    @property
    def wire_id(self) -> str:
        """The id the workers know this dispatch by: a re-dispatch is a new id, so it can never
        meet what a worker remembers of the attempt before it (an abort, a late handoff)."""
        return self.request_id if self.retries == 0 else f"{self.request_id}#{self.retries}"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def workers(self) -> set[str]:
        """The workers it is assigned to (one when both roles are the same worker)."""
        return {w for w in (self.prefill_worker, self.decode_worker) if w is not None}


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        routing: RoutingConfig,
        metrics: RouterMetrics,
        send: Callable[[str, Message], None],
        max_retries: int,
        heartbeat_interval: float,
        stall_timeout: float = 120.0,
        admission: AdmissionConfig | None = None,
    ):
        self.registry = registry
        self.routing = routing
        self.admission = admission or AdmissionConfig()
        self.waiting = WaitingQueue()  # requests waiting for a worker with room (admission)
        self.metrics = metrics
        self.send = send
        self.max_retries = max_retries
        self.heartbeat_interval = heartbeat_interval
        self.stall_timeout = stall_timeout
        self.generations: dict[str, Generation] = {}
        # (token ids, page size, their page hashes) of the last prompt hashed. The list itself
        # is kept, and compared by identity: an id() alone is reused once a list is freed, and
        # a new prompt would then get an old prompt's hashes (and be routed as if cached).
        self._hash_cache: tuple[list[int], int, list[int], str] | None = None
        self._seq = itertools.count()
        # Set by the runtime LoRA routes (router/lora_routes.py): a worker's answer to a load or
        # unload, and a worker just registered (sent the adapters loaded at runtime).
        self.on_adapter_result: Callable[[str, AdapterResult], None] | None = None
        self.on_registered: Callable[[str], None] | None = None
        # Set by the role switches (router/role_switch.py): a worker's RoleSwitchResult.
        self.on_role_switch_result: Callable[[str, RoleSwitchResult], None] | None = None

    # -- from the HTTP side --------------------------------------------------------------------

    def submit(
        self,
        group: list[Generation],
        priority: int = 0,
        *,
        refusable: bool = True,
        queueable: bool = True,
    ) -> Decision | None:
        """Route and dispatch the choices of one prompt (all to the same pair, so the prefill
        worker's prefix cache shares the prompt), or queue them here while every worker of a
        pool they need is full (None then; ``router/admission.py``). Raises ``NoWorkerError``
        when no worker could take them, ``Overloaded`` (nothing dispatched, nothing queued) when
        they are predicted to wait past --max-queue-delay. A request's first prompt is
        ``refusable``; its later ones are not (it was accepted), and a beam search's later
        steps are not ``queueable`` either: they hold their request's place."""
        first = group[0]
        if not queueable:
            decision: Decision | None = self._route(first, exclude=frozenset())
        else:
            decision = self._admit(first, priority, refusable)
        if decision is None:
            for gen in group:
                gen.queued = True
            self.waiting.push(group, priority)
            self.metrics.queued.set(len(self.waiting))
            return None
        self._dispatch_group(group, decision)
        return decision

    def finish_early(self, gen: Generation, cause: str) -> None:
        """The router ended the sequence (stop string, client gone): free it on its workers."""
        if gen.queued:
            # Never dispatched: it leaves the queue, with the other choices of its prompt.
            for member in self.waiting.remove(gen) or [gen]:
                member.queued = False
                member.finish_reason = "abort"
            self.metrics.abort_count(cause).inc()
            self.metrics.queued.set(len(self.waiting))
            return
        if self.generations.pop(gen.wire_id, None) is None:
            return
        # Counted before the workers hear of it: whoever sees the abort also sees the count.
        self.metrics.abort_count(cause).inc()
        self._record_end(gen, "stop" if cause == "stop_string" else "abort", time.monotonic())
        for worker_id in gen.workers():
            state = self.registry.workers.get(worker_id)
            if state is not None and gen.wire_id in state.inflight:
                self.send(worker_id, AbortRequest(gen.wire_id))
                self.registry.on_released(worker_id, gen.wire_id)
        self.metrics.inflight.set(len(self.generations))

    # -- from the control socket ---------------------------------------------------------------

    def on_message(self, sender: str, msg: Message, now: float) -> None:
        if isinstance(msg, TokenDelta):
            self._on_delta(sender, msg, now)
        elif isinstance(msg, TokenDeltas):
            for delta in msg.deltas:
                self._on_delta(sender, delta, now)
            columns = zip(
                msg.token_request_ids, msg.token_ids, msg.token_start_indices, strict=True
            )
            for request_id, token_id, start_index in columns:
                self._on_token(sender, request_id, token_id, start_index, now)
        elif isinstance(msg, Heartbeat):
            self._check_sender(sender, msg.worker_id)
            if msg.worker_id not in self.registry.workers:
                # A worker this router does not know (it restarted, or dropped the worker as
                # silent): ask it to register again rather than ignore it for good.
                self.send(sender, RegisterAck(accepted=False, reason=REREGISTER))
                return
            self.registry.on_heartbeat(msg, now)
            self._on_progress(msg, now)
        elif isinstance(msg, CacheEvents):
            self._check_sender(sender, msg.worker_id)
            self.registry.on_cache_events(msg, now)
        elif isinstance(msg, RequestFailed):
            self._on_failed(sender, msg)
        elif isinstance(msg, RegisterWorker):
            self._on_register(sender, msg, now)
        elif isinstance(msg, WorkerDraining):
            self._check_sender(sender, msg.worker_id)
            self._on_draining(msg, now)
        elif isinstance(msg, AdapterResult):
            self._check_sender(sender, msg.worker_id)
            if self.on_adapter_result is not None:
                self.on_adapter_result(sender, msg)
        elif isinstance(msg, RoleSwitchResult):
            self._check_sender(sender, msg.worker_id)
            if self.on_role_switch_result is not None:
                self.on_role_switch_result(sender, msg)
        else:
            raise ValueError(f"a worker may not send {type(msg).__name__}")

    def adapter_users(self, lora_name: str) -> int:
        """Requests in flight or queued here under LoRA adapter ``lora_name``."""
        return sum(1 for gen in self.generations.values() if gen.lora_name == lora_name)

    def remove_worker(self, worker_id: str, cause: str) -> None:
        state = self.registry.remove(worker_id)
        if state is None:
            return
        logger.warning("worker %s (%s) removed: %s", worker_id, state.role, cause)
        self.metrics.removed_workers.labels(cause).inc()
        self._rehome(worker_id, state.inflight, cause)

    def move_off(self, worker_id: str) -> int:
        """Move every request the router has on ``worker_id``, which stays registered (a role
        switch whose drain ran out of time), to other workers: each is aborted there and
        migrated with its tokens so far, or dispatched again, as when a worker leaves. Returns
        how many moved."""
        state = self.registry.workers.get(worker_id)
        if state is None:
            return 0
        moved = 0
        for wire_id in sorted(state.inflight):
            gen = self.generations.get(wire_id)
            if gen is None or gen.done:
                continue
            self._recover(gen, worker_id, f"worker {worker_id} changes role")
            moved += 1
        return moved

    def _rehome(self, worker_id: str, inflight: set[str], cause: str) -> None:
        """After ``worker_id`` left: re-dispatch or migrate the requests it still had."""
        self._count_workers()
        for wire_id in sorted(inflight):
            gen = self.generations.get(wire_id)
            if gen is None or gen.done:
                continue
            self._recover(gen, worker_id, f"worker {worker_id} was removed ({cause})")

    def expire(self, now: float) -> None:
        """Take out silent workers, and send again the requests that made no progress for
        ``stall_timeout``: no stream is left waiting for ever.

        Progress is not only tokens: a request queued or being prefilled has none for as long
        as that takes. It progresses while a heartbeat of its worker lists it and shows it, or
        the worker, further on than the last one (``_on_progress``). So a request is sent again
        only when no worker of it holds it (a lost message, a worker that forgot it) or its
        worker took no step and moved none of it for the whole window (stuck); a worker that
        went silent is taken out, and its requests moved, after ``heartbeat_timeout``."""
        for worker_id in self.registry.expired(now):
            self.remove_worker(worker_id, "heartbeat_timeout")
        stalled = [
            gen
            for gen in self.generations.values()
            if not gen.done and now - gen.progressed_at > self.stall_timeout
        ]
        for gen in stalled:
            self.metrics.stalls.inc()
            self._recover(gen, None, f"no progress for {self.stall_timeout:g} s")

    def _on_progress(self, msg: Heartbeat, now: float) -> None:
        """Requests a heartbeat lists as held: each moved if it, or its worker, came further."""
        state = self.registry.workers.get(msg.worker_id)
        if state is None:
            return
        for request_id, progress in zip(msg.held_request_ids, msg.held_progress, strict=True):
            gen = self.generations.get(request_id)
            if (
                gen is None
                or gen.done
                or msg.worker_id not in (gen.prefill_worker, gen.decode_worker)
            ):
                continue
            if progress != gen.held_progress or state.stepped:
                gen.held_progress = progress
                gen.progressed_at = now

    def _on_draining(self, msg: WorkerDraining, now: float) -> None:
        """A worker shutting down: route nothing new to it; once it leaves, move what it still
        has, as when a worker dies (but a drain is routine: it is not counted as a removal,
        which alerts), and tell it that everything it sent before has been read."""
        if not msg.leaving:
            if self.registry.on_draining(msg.worker_id, now):
                logger.info("worker %s is draining: nothing new is routed to it", msg.worker_id)
            return
        state = self.registry.remove(msg.worker_id)
        if state is not None:
            logger.info(
                "worker %s (%s) drained; %d requests left on it move elsewhere",
                msg.worker_id,
                state.role,
                len(state.inflight),
            )
            self._rehome(msg.worker_id, state.inflight, "drained")
        self.send(msg.worker_id, LeaveAck(msg.worker_id))

    # -- internals -----------------------------------------------------------------------------

    def _on_register(self, sender: str, msg: RegisterWorker, now: float) -> None:
        known = self.registry.workers.get(msg.worker_id)
        same_process = (
            msg.worker_id == sender and known is not None and known.incarnation == msg.incarnation
        )
        if same_process and known is not None and known.role == msg.role:
            # Sent again before our acknowledgement reached the worker (a busy router, a slow
            # start): it is the same process, holding what it held. Acknowledge again, no more.
            self.send(sender, RegisterAck(True, None, self.heartbeat_interval))
            return
        if same_process:
            # The same process under a new role: it changed role live (router/role_switch.py),
            # having served what it held first. Nothing of it is moved.
            reason = self.registry.change_role(msg, now)
            self.metrics.registrations.labels("accepted" if reason is None else "refused").inc()
            if reason is None:
                logger.info("worker %s changed role to %s", msg.worker_id, msg.role)
            else:
                # Its old registration stands; the refused worker stops, as any refused one.
                logger.warning("worker %s refused in its new role: %s", sender, reason)
            self.send(sender, RegisterAck(reason is None, reason, self.heartbeat_interval))
            self._count_workers()
            self.dispatch_waiting()
            return
        reason = None
        if msg.worker_id != sender:
            reason = f"worker_id {msg.worker_id!r} differs from the socket identity {sender!r}"
        elif msg.worker_id in self.registry.workers:
            # A restart under the same id: whatever it held is gone.
            self.remove_worker(msg.worker_id, "re_registered")
        if reason is None:
            reason = self.registry.register(msg, now)
        self.metrics.registrations.labels("accepted" if reason is None else "refused").inc()
        if reason is None:
            logger.info("worker %s registered as %s", msg.worker_id, msg.role)
        else:
            logger.warning("worker %s refused: %s", sender, reason)
        self.send(sender, RegisterAck(reason is None, reason, self.heartbeat_interval))
        if reason is None and self.on_registered is not None:
            self.on_registered(sender)
        self._count_workers()
        self.dispatch_waiting()  # room for what waits

    def _check_sender(self, sender: str, worker_id: str) -> None:
        if sender != worker_id:
            raise ValueError(f"{sender!r} sent a report for {worker_id!r}")

    # -- admission ------------------------------------------------------------------------------

    def _admit(self, gen: Generation, priority: int, refusable: bool) -> Decision | None:
        """Where a new request goes now, or None to wait in the queue; raises ``Overloaded``."""
        ahead = self.waiting.ahead_of(priority)
        decision = None if ahead else self._route_with_room(gen)
        limit = self.admission.max_queue_delay_s
        if limit is not None and refusable:
            # Whoever takes it in the end: the pair routing would choose with every worker.
            target = decision or self._route(gen, exclude=frozenset(), count=False)
            workers = self.registry.workers
            queued = 0 if decision is not None else ahead + 1
            wait = predicted_wait_s(
                None if target.prefill_worker_id is None else workers[target.prefill_worker_id],
                workers[target.decode_worker_id],
                queued,
                self.registry.pool(ROLE_DECODE),
            )
            if wait > limit:
                self.metrics.refusals.labels("queue_delay").inc()
                raise Overloaded(wait, limit)
        elif decision is None:
            self._route(gen, exclude=frozenset(), count=False)  # NoWorkerError: nobody at all
        return decision

    def _route_with_room(self, gen: Generation) -> Decision | None:
        """The pair for ``gen`` among workers below --max-inflight-per-worker; None when every
        worker of a pool it needs is full (a full prefill pool does not send a prompt to be
        prefilled on a decode worker instead: it waits for its turn)."""
        full = frozenset(
            w.worker_id for w in self.registry.workers.values() if is_full(w, self.admission)
        )
        if not full:
            return self._route(gen, exclude=frozenset())
        try:
            decision = self._route(gen, exclude=full, count=False)
        except NoWorkerError:
            return None
        if decision.reason == REASON_NO_PREFILL and self.registry.view().prefill:
            return None
        self.metrics.decision_count(decision.reason).inc()
        return decision

    def dispatch_waiting(self) -> None:
        """Dispatch the queue's head for as long as workers have room for it."""
        while self.waiting:
            try:
                decision = self._route_with_room(self.waiting.peek()[0])
            except NoWorkerError:
                return  # nobody to take it now; workers that register later will
            if decision is None:
                return
            group = self.waiting.pop()
            self.metrics.queued.set(len(self.waiting))
            for gen in group:
                gen.queued = False
            self._dispatch_group(group, decision)

    def _dispatch_group(self, group: list[Generation], decision: Decision) -> None:
        for gen in group:
            self.generations[gen.wire_id] = gen
            self._dispatch(gen, decision)
        self.metrics.inflight.set(len(self.generations))

    def _route(
        self,
        gen: Generation,
        exclude: frozenset[str],
        migrate: bool = False,
        count: bool = True,
    ) -> Decision:
        view = self.registry.view(exclude)
        page_size = self.registry.page_size or _FALLBACK_PAGE_SIZE
        tokens = gen.prompt_token_ids + gen.token_ids if migrate else None
        request = RequestView(
            num_prompt_tokens=len(tokens if tokens is not None else gen.prompt_token_ids),
            page_hashes=[]
            if migrate
            else self._hashes(gen.prompt_token_ids, page_size, gen.cache_namespace),
            page_size=page_size,
            num_new_tokens_max=gen.params.max_tokens,
            session_id=gen.session_id,
            decode_only=migrate,
            lora_name=gen.lora_name,
        )
        decision = route(request, view, self.routing)
        if count:
            self.metrics.decision_count(decision.reason).inc()
        return decision

    def _hashes(self, token_ids: list[int], page_size: int, namespace: str = "") -> list[int]:
        # The n choices of one prompt are routed one after another, and a retry routes again:
        # keep the last prompt's hashes, keyed by its tokens' values (an id can be reused).
        cached = self._hash_cache
        if (
            cached is not None
            and cached[1] == page_size
            and cached[3] == namespace
            and cached[0] == token_ids
        ):
            return cached[2]
        hashes = page_hashes(token_ids, page_size, namespace=namespace)
        self._hash_cache = (list(token_ids), page_size, hashes, namespace)
        return hashes

    def _dispatch(self, gen: Generation, decision: Decision, migrate: bool = False) -> None:
        now = time.monotonic()
        if gen.retries == 0:
            self.metrics.request.dispatched(now - gen.arrived_at)
            self.metrics.traffic.arrived(
                gen.arrived_at, len(gen.prompt_token_ids), gen.params.max_tokens
            )
        gen.progressed_at = now
        gen.held_progress = -1
        gen.dispatched_at = now
        gen.prefill_worker = decision.prefill_worker_id
        gen.decode_worker = decision.decode_worker_id
        params = gen.params
        decode_state = self.registry.workers[decision.decode_worker_id]
        output_ids = list(gen.token_ids) if migrate else []
        total = len(gen.prompt_token_ids) + gen.params.max_tokens
        pages = pages_for(total, decode_state.page_size)
        if decision.prefill_worker_id is None:
            msg: Message = DecodeRequest(
                gen.wire_id,
                gen.prompt_token_ids,
                params,
                output_ids,
                gen.lora_name,
                self._prefix_source(decision),
            )
            # Counted as queued prefill there until it reports it (the overflow rule reads it).
            local_tokens = len(gen.prompt_token_ids) + len(output_ids)
            self.registry.on_dispatch(
                decision.decode_worker_id, gen.wire_id, local_tokens, pages, now
            )
            self.send(decision.decode_worker_id, msg)
            return
        uncached = len(gen.prompt_token_ids) - decision.num_cached_tokens
        self.registry.on_dispatch(decision.prefill_worker_id, gen.wire_id, uncached, 0, now)
        self.registry.on_dispatch(decision.decode_worker_id, gen.wire_id, 0, pages, now)
        assert decode_state.handoff_endpoint is not None  # checked at registration
        self.send(
            decision.prefill_worker_id,
            PrefillRequest(
                gen.wire_id,
                gen.prompt_token_ids,
                params,
                decision.decode_worker_id,
                decode_state.handoff_endpoint,
                gen.lora_name,
            ),
        )

    def _prefix_source(self, decision: Decision) -> PrefixSource | None:
        """Where the decode worker fetches the prompt's leading pages from (the decision's
        prefill worker), or None."""
        state = self.registry.workers.get(decision.prefix_worker_id or "")
        if state is None or state.kv_endpoint is None or decision.prefix_pages < 1:
            return None
        return PrefixSource(
            state.worker_id, state.kv_transfer, state.kv_endpoint, decision.prefix_pages
        )

    def _on_delta(self, sender: str, msg: TokenDelta, now: float) -> None:
        gen = self._progressing(sender, msg.request_id, now)
        if gen is None:
            return
        if msg.first or (msg.start_index == 0 and not gen.token_ids):
            # A decode worker prefilling locally may not mark its first token as ``first``.
            gen.num_cached_tokens = msg.num_cached_tokens
            if msg.prompt_logprobs is not None:
                gen.prompt_logprobs = msg.prompt_logprobs
            self._record_first_token(gen, msg, now)
            self.registry.on_prefilled(sender, gen.wire_id)
        elif msg.timings is not None:
            self.metrics.request.decode_stages(msg.timings)
        if msg.start_index > len(gen.token_ids):
            gen.early[msg.start_index] = msg
            return
        self._apply(gen, msg, now)
        if (
            sender == gen.prefill_worker
            and msg.first
            and gen.finish_reason is None
            and gen.prefill_worker is not None
        ):
            # The prompt is handed off: the prefill worker no longer holds the request.
            self.registry.on_released(gen.prefill_worker, gen.wire_id)
            self.dispatch_waiting()
        self._settle(gen, now)

    def _on_token(
        self, sender: str, request_id: str, token_id: int, start_index: int, now: float
    ) -> None:
        """One token of a ``TokenDeltas`` column: a decode step's usual news, kept as its id."""
        gen = self.generations.get(request_id)
        if (
            gen is None
            or start_index == 0
            or start_index != len(gen.token_ids)
            or gen.scored is not None
        ):
            # Not the next token of a plain request under way (a first token, a gap, a resend,
            # a token that ought to carry its logprob, an unknown request): the general path.
            self._on_delta(
                sender, TokenDelta(request_id, [TokenSample(token_id)], start_index), now
            )
            return
        if self._progressing(sender, request_id, now) is None:
            return
        self._append(gen, [token_id], None, now)
        self._settle(gen, now)

    def _progressing(self, sender: str, request_id: str, now: float) -> Generation | None:
        """The running sequence ``request_id`` if ``sender`` serves it: its progress is noted."""
        gen = self.generations.get(request_id)
        if gen is None or gen.done:
            return None  # finished, aborted or unknown: a late message
        if sender not in (gen.prefill_worker, gen.decode_worker):
            return None  # from a worker the request has moved away from
        self.registry.touch(sender, now)
        gen.progressed_at = now
        return gen

    def _settle(self, gen: Generation, now: float) -> None:
        """After news of ``gen``: deltas that waited for it, the end if it came, the run told."""
        while len(gen.token_ids) in gen.early:
            self._apply(gen, gen.early.pop(len(gen.token_ids)), now)
        if gen.finish_reason is not None:
            gen.finished_at = now
            self._record_end(gen, gen.finish_reason, now)
            self._release(gen)
        gen.sink.put_nowait(gen.index)

    def _apply(self, gen: Generation, msg: TokenDelta, now: float) -> None:
        skip = len(gen.token_ids) - msg.start_index  # a migrated request may resend a few
        new = msg.samples[skip:] if skip > 0 else msg.samples
        if new:
            self._append(gen, [s.token_id for s in new], new, now)
        if msg.finish_reason is not None:
            gen.finish_reason = msg.finish_reason

    def _append(
        self, gen: Generation, token_ids: list[int], samples: list[TokenSample] | None, now: float
    ) -> None:
        since_last = now - gen.last_token_at if gen.token_ids else None
        gen.token_ids.extend(token_ids)
        if gen.scored is not None:
            gen.scored.extend(samples or [TokenSample(t) for t in token_ids])
        gen.last_token_at = now
        self.metrics.request.tokens(len(token_ids), since_last)

    def _record_first_token(self, gen: Generation, msg: TokenDelta, now: float) -> None:
        gen.first_token_at = now
        if msg.timings is not None:
            gen.prefill_s = msg.timings.prefill_s
        self.metrics.request.first_token(
            ttft_s=now - gen.arrived_at,
            router_queue_s=gen.dispatched_at - gen.arrived_at,
            since_dispatch_s=now - gen.dispatched_at,
            times=msg.timings,
            num_prompt_tokens=len(gen.prompt_token_ids),
            num_cached_tokens=msg.num_cached_tokens,
        )

    def _record_end(self, gen: Generation, reason: str, now: float) -> None:
        first = gen.first_token_at
        if first is not None:
            generated = len(gen.token_ids)
            decode_s = gen.last_token_at - first
            self.metrics.traffic.ended(
                Finished(
                    now,
                    len(gen.prompt_token_ids),
                    generated,
                    first - gen.arrived_at,
                    decode_s / (generated - 1) if generated > 1 else 0.0,
                    reason,
                )
            )
        self.metrics.request.ended(
            reason,
            e2e_s=now - gen.arrived_at,
            ttft_s=None if first is None else first - gen.arrived_at,
            decode_s=0.0 if first is None else gen.last_token_at - first,
            num_generated=len(gen.token_ids),
            prefill_s=gen.prefill_s,
        )

    def _on_failed(self, sender: str, msg: RequestFailed) -> None:
        gen = self.generations.get(msg.request_id)
        if gen is None or gen.done or sender not in (gen.prefill_worker, gen.decode_worker):
            return
        if msg.retryable:
            self._recover(gen, sender, f"worker {sender} failed the request: {msg.error}")
        else:
            self._fail(gen, f"the request failed on worker {sender}: {msg.error}", 500)

    def _recover(self, gen: Generation, failed_worker: str | None, why: str) -> None:
        """Re-dispatch (no token yet) or migrate (tokens so far) under a new id, away from
        ``failed_worker`` (None: to wherever routing says, the old workers included)."""
        if gen.retries >= self.max_retries:
            self._fail(gen, f"{why}; gave up after {self.max_retries} retries", 503)
            return
        for worker_id in gen.workers():
            state = self.registry.workers.get(worker_id)
            # The failed worker is told too: one removed as silent may only be slow, and it
            # should not go on computing a request that now runs elsewhere.
            if worker_id == failed_worker or (state is not None and gen.wire_id in state.inflight):
                self.send(worker_id, AbortRequest(gen.wire_id))
            self.registry.on_released(worker_id, gen.wire_id)
        # The next attempt goes out under a new id; whatever still comes for the old one is late.
        self.generations.pop(gen.wire_id, None)
        gen.retries += 1
        self.generations[gen.wire_id] = gen
        gen.early.clear()
        migrate = bool(gen.token_ids)
        try:
            exclude = frozenset() if failed_worker is None else frozenset({failed_worker})
            decision = self._route(gen, exclude=exclude, migrate=migrate)
        except NoWorkerError as exc:
            self._fail(gen, f"{why}, and {exc}", 503)
            return
        self.metrics.redispatches.labels("migrate" if migrate else "prefill").inc()
        logger.info(
            "%s: %s to %s", gen.request_id, "migrating" if migrate else "re-dispatching", decision
        )
        self._dispatch(gen, decision, migrate=migrate)

    def _fail(self, gen: Generation, error: str, status: int) -> None:
        gen.error = error
        gen.error_status = status
        self._record_end(gen, "error", time.monotonic())
        self._release(gen)
        gen.sink.put_nowait(gen.index)

    def _release(self, gen: Generation) -> None:
        self.generations.pop(gen.wire_id, None)
        for worker_id in (gen.prefill_worker, gen.decode_worker):
            if worker_id is not None:
                self.registry.on_released(worker_id, gen.wire_id)
        self.metrics.inflight.set(len(self.generations))
        self.dispatch_waiting()

    def _count_workers(self) -> None:
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(role).set(len(self.registry.pool(role)))

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._seq)}"
