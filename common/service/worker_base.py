"""What a prefill and a decode worker share: the engine, the router link, metrics, the loop.

A worker's one main loop is::

    handle what arrived (router requests, handoffs, transfer progress)
    schedule() -> run() -> postprocess()   while there is work
    report to the router (token deltas, heartbeats, prefix-cache events)

It polls its sockets without blocking while it has work, and sleeps in a ``zmq.Poller`` on them
while it has none.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping

import zmq

from common import cluster_auth
from common.cluster_auth import ClusterAuth
from common.engine.args import add_engine_args, engine_config_from_args
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.llm_engine import LLMEngine
from common.engine.persistent_batch import DecodeOutputs
from common.engine.sampler import PromptLogprob
from common.engine.sequence import Sequence, first_output_prompt_logprobs
from common.messages import PROTOCOL_VERSION, Message
from common.metrics import (
    AUTH_FAILURES,
    GENERATED_TOKENS,
    ITERATION_TOKENS,
    KV_PAGES_RELEASED,
    KV_USAGE,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_HIT_TOKENS,
    PROMPT_TOKENS_COMPUTED,
    PROMPT_TOKENS_QUEUED,
    RUNNING,
    STEP_BATCH_SIZE,
    STEP_SECONDS,
    WAITING,
)
from common.protocol import (
    REREGISTER,
    SWITCH_REFUSED,
    AdapterResult,
    CacheEvents,
    Heartbeat,
    LoadAdapter,
    PromptTokenLogprob,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RoleSwitchResult,
    StageTimes,
    SwitchRole,
    TokenDelta,
    TokenDeltas,
    TokenSample,
    UnloadAdapter,
)
from common.sampling_params import SamplingParams
from common.service.core_loan import CoreLoan, add_core_loan_args
from common.service.drain import Drain, add_drain_args
from common.service.health import Probes, serve_worker_http
from common.service.role_switch import RoleSwitch, switch_problem
from common.service.router_link import RouterLink
from common.service.step_io import StepIO
from common.service.throughput import Throughput
from common.startup_objects import startup_objects_frozen

logger = logging.getLogger(__name__)

# While idle the loop wakes at least this often, for heartbeats and lease deadlines.
_IDLE_POLL_MS = 20
# ... and this often while transfers progress where no socket says so (see io_in_flight).
_IN_FLIGHT_POLL_MS = 1


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router", required=True, help="the router's control socket, tcp://HOST:PORT"
    )
    parser.add_argument("--worker-id", default=None, help="default: ROLE-HOSTNAME-PID")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address this worker's sockets bind and advertise"
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--kv-transfer", default="zmq", choices=["zmq", "nixl"])
    parser.add_argument("--register-timeout", type=float, default=120.0)
    parser.add_argument(
        "--cluster-secret-file",
        default=None,
        help=f"the cluster secret's file (default: ${cluster_auth.SECRET_ENV}); peers on the "
        "internal sockets must hold it",
    )
    cluster_auth.add_insecure_flag(parser)
    parser.add_argument("--log-level", default="INFO")
    add_drain_args(parser)
    add_core_loan_args(parser)
    add_engine_args(parser)


def sample_to_wire(sample) -> TokenSample:
    if sample.top_logprobs is None:
        return TokenSample(sample.token_id, sample.logprob)
    ids = [token_id for token_id, _ in sample.top_logprobs]
    logprobs = [logprob for _, logprob in sample.top_logprobs]
    return TokenSample(sample.token_id, sample.logprob, ids, logprobs)


def prompt_logprobs_to_wire(
    scored: list[PromptLogprob] | None,
) -> list[PromptTokenLogprob] | None:
    if scored is None:
        return None
    return [
        PromptTokenLogprob(
            p.token_id, p.logprob, p.rank, [t for t, _ in p.top_logprobs],
            [lp for _, lp in p.top_logprobs],
        )
        for p in scored
    ]  # fmt: skip


def _says_only_its_token(seq: Sequence, num_output_tokens: int) -> bool:
    """Whether the delta of ``seq``'s newest token (its ``num_output_tokens``-th) would hold
    that token alone: not its first output token here (which carries the prefix-cache hit,
    prompt logprobs and stage times), no stage times pending after a handoff, no finish, no
    logprob."""
    return (
        num_output_tokens != 1
        and seq.finish_reason is None
        and seq.handoff_wait_s is None
        and seq.samples[-1].logprob is None
    )


def stage_times(seq: Sequence, num_new: int) -> StageTimes | None:
    """What to tell the router of ``seq``'s stages here with its ``num_new`` newest tokens:
    the wait and the prefill with the first token it produced, the handoff and the wait for a
    decode slot with the first step after a handoff; otherwise None."""
    queued, started = seq.queued_time, seq.first_scheduled_time
    if queued is None or started is None:
        return None
    if seq.num_output_tokens == num_new:
        return StageTimes(queue_s=started - queued, prefill_s=time.monotonic() - started)
    if seq.handoff_wait_s is not None:
        handoff_s, seq.handoff_wait_s = seq.handoff_wait_s, None  # reported once
        return StageTimes(handoff_s=handoff_s, decode_queue_s=started - queued)
    return None


class WorkerHost:
    """What a worker process keeps for its whole life, whichever role it serves: its id and
    incarnation, the engine (weights, KV pool, page manager), the router link and the
    cluster's auth, the drain, the health and metrics server, the core loan. A role
    (``WorkerService``) is built around it, and a live role switch builds the other role around
    the same one."""

    def __init__(self, args: argparse.Namespace, role: str) -> None:
        # Before the engine loads: a worker that must not start says so at once.
        secret = cluster_auth.secret_for_binding(
            args.cluster_secret_file, [args.host], args.insecure_no_auth
        )
        # The role it starts in names it; the name stays through role switches.
        self.worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.incarnation = secrets.token_hex(8)  # this process's: a restart gets a new one
        self.engine = LLMEngine(engine_config_from_args(args), role=role)
        self.auth = ClusterAuth(
            secret,
            lambda name: AUTH_FAILURES.labels(socket=name).inc(),
        )
        cluster_auth.install(self.auth)  # the KV side channel's sockets take it from there
        self.context = zmq.Context()
        self.link = RouterLink(self.context, args.router, self.worker_id, self.auth)
        self.drain = Drain(self.worker_id, args.drain_timeout)
        self.probes = Probes()
        self.metrics_url = serve_worker_http(args.host, args.metrics_port, self.probes)
        self.core_loan = self._take_core_loan(args)

    def _take_core_loan(self, args: argparse.Namespace) -> CoreLoan | None:
        """This worker's side of a core loan (``pdserve up`` pairs workers without a GPU): it
        always lends its cores while it waits, and borrows its partner's for its forward while
        that one waits, unless its ranks split the model (their steps go in lockstep)."""
        loan = CoreLoan.from_args(args)
        if loan is None:
            return None
        if self.engine.config.tensor_parallel_size == 1 and self.engine.device.type != "cuda":
            self.engine.model.layer_threads = loan
            logger.info("%s borrows %d idle cores of its pair", self.worker_id, args.lent_cores)
        return loan

    def close(self) -> None:
        if self.core_loan is not None:
            self.core_loan.mark_busy(False)  # gone: its cores are free for the paired worker
            self.core_loan.close()
        self.link.close()
        self.auth.close()


class WorkerService(ABC):
    role: str
    # Whether a step's token deltas (and cache events) go out beside the next step's forward
    # rather than at once: the decode worker's choice, whose device would otherwise wait for
    # them every step. A prefill worker's first token is its request's TTFT, and must reach
    # the router before the handoff does: it goes at once.
    output_beside_forward = False

    def __init__(self, args: argparse.Namespace, host: WorkerHost | None = None) -> None:
        """A new worker process (``host`` None), or the role that follows another in the same
        process (a live role switch: ``host`` is what the earlier role ran on)."""
        self.args = args
        self.host = host if host is not None else WorkerHost(args, self.role)
        self.worker_id = self.host.worker_id
        self.incarnation = self.host.incarnation
        self.engine = self.host.engine
        self.scheduler = self.engine.scheduler
        self.page_manager = self.engine.page_manager
        self.auth = self.host.auth
        self.context = self.host.context
        self.link = self.host.link
        self.drain = self.host.drain
        self.probes = self.host.probes
        self.metrics_url = self.host.metrics_url
        self.core_loan = self.host.core_loan
        # The worker classes this process can become, by role (``run_worker``'s ``roles``):
        # its own, and the other one where a role switch may build it.
        self.roles: dict[str, type[WorkerService]] = {self.role: type(self)}
        self.role_switch: RoleSwitch | None = None  # a switch under way
        # The role this one handed over to (the loop then continues in it), and what the
        # new role tells the router once it has registered.
        self.successor: WorkerService | None = None
        self.switch_result: RoleSwitchResult | None = None
        self._stopping = False
        self._step_io: StepIO
        self.last_step_seconds = 0.0  # how long the latest step took, start to end
        self._last_heartbeat = 0.0
        self._prompt_tokens_seen = 0
        self._preemptions_seen = 0
        self._released_pages_seen = 0
        # What the heartbeats report of this worker's progress and pace (see ``heartbeat``).
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.step_tokens = 0
        self.step_rows = 0
        self.prefill_rate = Throughput()
        self.finish_rate = Throughput()

    # -- what each role supplies ----------------------------------------------------------------

    @abstractmethod
    def registration(self) -> RegisterWorker: ...

    @abstractmethod
    def handle(self, msg: Message) -> None:
        """Act on one message from the router."""

    @abstractmethod
    def poll_io(self) -> None:
        """Serve the role's own sockets (handoffs, KV transfers) without blocking."""

    @abstractmethod
    def extra_sockets(self) -> list:
        """Sockets besides the router link whose traffic should wake the idle loop."""

    @abstractmethod
    def on_finished_step(
        self, batch: list[ScheduledSequence], outputs: list[SequenceOutput]
    ) -> None:
        """Report what one step produced: ``outputs`` has one entry per sampling sequence."""

    def num_pending(self) -> int:
        """Requests held outside the scheduler (e.g. waiting for their pages)."""
        return 0

    def forget(self, request_id: str) -> None:  # noqa: B027 (most roles keep nothing beside)
        """The scheduler gave ``request_id`` up: drop what the role keeps of it beside."""

    def pending_progress(self) -> dict[str, int]:
        """Each request held outside the scheduler, with a count that grows as it moves (pages
        announced and received): what the heartbeat reports of them beside the scheduler's."""
        return {}

    def num_held(self) -> int:
        """Requests this worker holds: running, waiting, or outside the scheduler. A drain
        ends when none are left."""
        return sum(1 for _ in self.scheduler.sequences()) + self.num_pending()

    def serve_during_step(
        self,
    ) -> tuple[Callable[[], None], list | Callable[[], list]] | None:
        """What a helper thread should serve while a step runs (``common/service/step_io``):
        a function that answers peers, and the sockets whose traffic calls for it (a list, or a
        function giving the list of the moment); None if the role's sockets can wait for the
        step's end. The function must leave alone what the step reads: the model, the batch's
        sequences and their pages. It may take free pages and queue requests, which the main
        loop looks at only between steps."""
        return None

    def steps_are_short(self) -> bool:
        """Whether this worker's steps are launched on a device and take a few milliseconds, so
        that a helper thread woken and waited for every step's output would cost more than it
        hides (``StepIO``'s ``pulse_inline``)."""
        return False

    def io_in_flight(self) -> bool:
        """Whether I/O is progressing that no socket will announce (a NIXL READ), so the idle
        loop should come back to ``poll_io`` within a millisecond."""
        return False

    # -- the loop -------------------------------------------------------------------------------

    def serve(self) -> None:
        """Register and run the loop until the worker stops, leaves (a drain), or hands over
        to another role (``successor``, whose ``serve`` the caller runs next)."""
        self.drain.install()  # SIGTERM: finish or hand off what this worker holds, then exit
        self.link.register(self.registration(), self.args.register_timeout)
        self._report_whole_cache()
        logger.info(
            "%s registered with %s as %s; metrics at %s",
            self.worker_id,
            self.args.router,
            self.role,
            self.metrics_url,
        )
        if self.switch_result is not None:
            # After the registration, on the same socket: the router has taken the new role
            # when it reads this.
            self.link.send(self.switch_result)
        self.start_step_io()
        try:
            while not self._stopping:
                self.turn()
                self.probes.turned(self.drain.draining)
                if self.drain.poll(self.link, self.num_held()):
                    break
                if self.role_switch is not None and self._try_switch(self.role_switch):
                    break
        finally:
            self._step_io.close()  # before the sockets it serves are closed
            if self.successor is not None:
                self.close_role()
            else:
                self.close()

    # -- a live role switch (common/service/role_switch.py) -------------------------------------

    def _on_switch_role(self, order: SwitchRole) -> None:
        problem = switch_problem(
            order.role,
            self.role,
            allowed=self.args.role_switch,
            buildable=order.role in self.roles,
            tensor_parallel_size=self.engine.tp.size,
            speculative=self.engine.config.speculative.enabled,
            draining=self.drain.draining,
            switching=self.role_switch is not None,
        )
        if problem is not None:
            logger.warning("refusing to switch to %s: %s", order.role, problem)
            self.link.send(
                RoleSwitchResult(
                    self.worker_id, order.operation_id, self.role, SWITCH_REFUSED, problem
                )
            )
            return
        self.role_switch = RoleSwitch(order, self.role)
        logger.info(
            "switching from %s to %s: %d requests to finish within %g s",
            self.role,
            order.role,
            self.num_held(),
            order.drain_timeout_s,
        )

    def _try_switch(self, switch: RoleSwitch) -> bool:
        """Once the worker holds nothing, build the new role (then True: the loop ends and the
        successor takes over); on a timeout or a failure, answer so and go on in this role."""
        held = self.num_held()
        if held or self.engine.has_unfinished:
            if switch.timed_out():
                self._switch_failed(switch, f"drain timeout: {held} requests still held")
            return False
        try:
            self.successor = self._become(switch.role)
        except Exception as exc:  # the old role is intact: it serves on, and says why
            logger.exception("building the %s role failed", switch.role)
            self._switch_failed(switch, f"building the {switch.role} role failed: {exc}")
            return False
        self.successor.roles = self.roles
        self.successor.switch_result = switch.switched(self.worker_id)
        self.role_switch = None
        return True

    def _become(self, role: str) -> WorkerService:
        """The ``role`` worker around this engine; this role's scheduler is put back (and this
        role stays whole) if building it raises."""
        in_use = self.page_manager.num_pages - self.page_manager.num_free_pages
        if in_use:
            # Nothing is held, so these pages have no owner left: a leak, and not the new
            # role's to inherit.
            raise RuntimeError(f"{in_use} KV pages are still in use")
        previous = self.engine.set_role(role)
        try:
            return self.roles[role](self.args, self.host)
        except BaseException:
            self.engine.set_role(self.role, previous)
            raise

    def _switch_failed(self, switch: RoleSwitch, error: str) -> None:
        logger.warning("the switch to %s failed, serving as %s still: %s", switch.role,
                       self.role, error)  # fmt: skip
        self.link.send(switch.failed(self.worker_id, error))
        self.role_switch = None

    def start_step_io(self, pulse_inline: bool | None = None) -> None:
        """Start the helper that serves peers while a step runs, and heartbeats and sends the
        previous step's output then: the helper, or (``pulse_inline``, by default where
        ``steps_are_short``) the main loop itself once the forward is launched."""
        serve, sockets = self.serve_during_step() or (None, [])
        if pulse_inline is None:
            pulse_inline = self.steps_are_short()
        # Heartbeats go on during a step: liveness must not depend on how long a step takes.
        # And the previous step's output is sent then, while the forward runs.
        self._step_io = StepIO(
            serve,
            sockets,
            pulse=self._pulse,
            pulse_now=self.link.has_deferred,
            pulse_inline=pulse_inline,
        )

    def turn(self) -> None:
        """One pass of the main loop: sleep on the sockets if idle, handle what arrived, serve
        the role's own sockets, step if there is work (a step launched ahead is work too:
        its tokens are read by the next), report."""
        if not self.engine.has_unfinished:
            if self.core_loan is not None:
                self.core_loan.mark_busy(False)  # the paired worker may run on our cores
            self._wait()
        for msg in self.link.receive():
            if isinstance(msg, RegisterAck):
                self._on_register_ack(msg)
            elif isinstance(msg, LoadAdapter | UnloadAdapter):
                self._update(msg)
            elif isinstance(msg, SwitchRole):
                self._on_switch_role(msg)
            else:
                self.handle(msg)
        self.poll_io()
        if self.engine.has_unfinished:
            if self.core_loan is not None:
                self.core_loan.mark_busy(True)
            self.step()
        self._report()
        if not self.engine.has_unfinished:
            self.link.flush()  # no forward to send them beside: the last step's output goes now

    def stop(self) -> None:
        self._stopping = True

    def step(self) -> None:
        started = time.perf_counter()
        computed = self.scheduler.num_prompt_tokens_computed
        batch, outputs = self.engine.run_step(around_forward=self._step_io)
        self.last_step_seconds = time.perf_counter() - started
        self.num_steps += 1
        self.busy_seconds += self.last_step_seconds
        if isinstance(outputs, DecodeOutputs):  # a plain decode step: one token a row
            step_tokens = generated = len(batch)
            left = len(outputs.left)
        else:
            step_tokens = sum(item.num_new_tokens + item.num_draft_slots for item in batch)
            generated = sum(len(out.new_samples) for out in outputs)
            left = sum(1 for out in outputs if out.left_batch)
        self.step_tokens += step_tokens
        self.step_rows += len(batch)
        prompt_tokens = self.scheduler.num_prompt_tokens_computed - computed
        if prompt_tokens:
            self.prefill_rate.record(prompt_tokens, self.last_step_seconds)
        if left:
            self.finish_rate.record(left)
        STEP_SECONDS.observe(self.last_step_seconds)
        STEP_BATCH_SIZE.observe(len(batch))
        ITERATION_TOKENS.observe(step_tokens)
        GENERATED_TOKENS.inc(generated)
        self.on_finished_step(batch, outputs)

    def _on_register_ack(self, ack: RegisterAck) -> None:
        if ack.accepted:
            self.link.heartbeat_interval = ack.heartbeat_interval
            self._report_whole_cache()
        elif ack.reason == REREGISTER:
            logger.warning("the router does not know this worker; registering again")
            self.link.send(self.registration())
        else:
            logger.error("the router refused this worker: %s", ack.reason)
            self.stop()

    def _report_whole_cache(self) -> None:
        self.page_manager.drain_events()
        stored = self.page_manager.cached_hashes()
        self.link.send(CacheEvents(self.worker_id, stored, [], reset=True))
        tiers = self.page_manager.tiers
        if tiers is not None:
            for held in tiers.held_hashes():
                self.link.send(
                    CacheEvents(self.worker_id, held.stored, [], reset=True, tier=held.tier)
                )

    def _wait(self) -> None:
        if self.link.has_input():
            return  # read with the registration's acknowledgement: no need to sleep for it
        poller = zmq.Poller()
        for sock in (self.link.socket, *self.extra_sockets()):
            poller.register(sock, zmq.POLLIN)
        busy = self.io_in_flight() or (self.engine.lora is not None and self.engine.lora.adding)
        poller.poll(_IN_FLIGHT_POLL_MS if busy else _IDLE_POLL_MS)

    def _report(self) -> None:
        for seq, error in self.scheduler.drain_failed():
            # Its grammar could not be compiled here (the router checks each one first, so
            # this is rare), or its adapter's files went: no other worker would do better.
            self.fail(seq.request_id, error, retryable=False)
            self.forget(seq.request_id)
        self._answer_adapter_loads()
        events = self.page_manager.drain_events()
        if events:
            self._send_output(CacheEvents(self.worker_id, events.stored, events.removed))
        tiers = self.page_manager.tiers
        if tiers is not None:
            for tier_events in tiers.drain_events():
                self._send_output(
                    CacheEvents(
                        self.worker_id,
                        tier_events.stored,
                        tier_events.removed,
                        tier=tier_events.tier,
                    )
                )
        computed = self.scheduler.num_prompt_tokens_computed
        if computed > self._prompt_tokens_seen:
            PROMPT_TOKENS_COMPUTED.inc(computed - self._prompt_tokens_seen)
            self._prompt_tokens_seen = computed
        preempted = self.scheduler.num_preemptions
        if preempted > self._preemptions_seen:
            NUM_PREEMPTIONS.inc(preempted - self._preemptions_seen)
            self._preemptions_seen = preempted
        released = self.scheduler.num_released_pages
        if released > self._released_pages_seen:
            KV_PAGES_RELEASED.inc(released - self._released_pages_seen)
            self._released_pages_seen = released
        self._heartbeat_if_due()

    def _pulse(self) -> None:
        """What the step helper does inside a step: send the previous step's output, and a
        heartbeat if one is due."""
        self.link.flush()
        self._heartbeat_if_due()

    def _heartbeat_if_due(self) -> None:
        """Send a heartbeat if one is due: from the loop, or from the step helper meanwhile
        (never both at once; see ``StepIO``)."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.link.heartbeat_interval:
            self._last_heartbeat = now
            self.link.send(self.heartbeat())

    def heartbeat(self) -> Heartbeat:
        scheduler, pages = self.scheduler, self.page_manager
        queued = sum(
            max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in scheduler.sequences()
        )
        RUNNING.set(len(scheduler.running))
        held_by_scheduler = sum(1 for _ in scheduler.sequences())
        waiting = held_by_scheduler - len(scheduler.running) + self.num_pending()
        WAITING.set(waiting)
        KV_USAGE.set(pages.usage)
        PROMPT_TOKENS_QUEUED.set(queued)
        held = {
            seq.request_id: seq.num_computed_tokens + seq.num_output_tokens
            for seq in scheduler.sequences()
        }
        held.update(self.pending_progress())
        return Heartbeat(
            self.worker_id,
            num_running=len(scheduler.running),
            num_waiting=waiting,
            queued_prefill_tokens=queued,
            num_free_pages=pages.num_free_pages,
            kv_usage=pages.usage,
            num_steps=self.num_steps,
            held_request_ids=list(held),
            held_progress=list(held.values()),
            prefill_tokens_per_s=self.prefill_rate.per_busy_second(),
            finished_per_s=self.finish_rate.per_second(),
            busy_seconds=self.busy_seconds,
            step_tokens=self.step_tokens,
            step_rows=self.step_rows,
            **self._adapters_held(),
        )

    def _adapters_held(self) -> dict[str, list[str]]:
        lora = self.engine.lora
        if lora is None:
            return {}
        return {
            "lora_adapters": lora.names,
            "loras_on_host": lora.on_host(),
            "loras_on_device": lora.on_device(),
        }

    # -- shared helpers -------------------------------------------------------------------------

    def checked_params(self, request_id: str, params: SamplingParams) -> SamplingParams | None:
        """The request's sampling params (their values checked when the codec made them), or
        None after telling the router they name a token outside this model's vocabulary."""
        try:
            params.check_token_ids(self.engine.model_config.vocab_size)
        except ValueError as exc:
            self.fail(request_id, f"bad sampling params: {exc}", retryable=False)
            return None
        return params

    def _update(self, msg: LoadAdapter | UnloadAdapter) -> None:
        """Load or unload a LoRA adapter as the router asks, and answer: an unload at once, a
        load once its files are read off this thread (``_answer_adapter_loads``)."""
        error = self._refuse_update(msg)
        if error is None and isinstance(msg, LoadAdapter):
            lora = self.engine.lora
            assert lora is not None
            try:
                lora.start_add(msg.lora_name, msg.lora_path, msg.operation_id)
                return
            except ValueError as exc:
                error = f"worker {self.worker_id}: {exc}"
        self.link.send(AdapterResult(self.worker_id, msg.operation_id, error))

    def _refuse_update(self, msg: LoadAdapter | UnloadAdapter) -> str | None:
        """Why the update cannot be made (an unload is made here); None to go on."""
        lora = self.engine.lora
        if lora is None:
            return f"worker {self.worker_id} serves no LoRA adapters (--enable-lora)"
        name = msg.lora_name
        if self.engine.tp.size > 1:
            # Each rank holds its own slices; only the adapters given at start reach them all.
            return (
                f"worker {self.worker_id}: LoRA adapters are loaded at runtime only without "
                "tensor parallelism"
            )
        if isinstance(msg, LoadAdapter):
            return None
        in_use = self.adapter_users(name)
        if in_use:
            return f"LoRA adapter {name!r} is in use by {in_use} requests on {self.worker_id}"
        try:
            lora.remove(name)
        except ValueError as exc:
            return f"worker {self.worker_id}: {exc}"
        return None

    def _answer_adapter_loads(self) -> None:
        """Answer each runtime load whose files have been read (served from now on) or could
        not be."""
        lora = self.engine.lora
        if lora is None:
            return
        for operation_id, error in lora.finish_adds():
            if error is not None:
                error = f"worker {self.worker_id}: {error}"
            self.link.send(AdapterResult(self.worker_id, operation_id, error))

    def adapter_users(self, lora_name: str) -> int:
        """Requests this worker holds that compute under ``lora_name``."""
        return sum(1 for seq in self.scheduler.sequences() if seq.lora_name == lora_name)

    def under_adapter(self, seq: Sequence, lora_name: str | None) -> bool:
        """Put ``seq`` under LoRA adapter ``lora_name`` (None: the base model), or tell the
        router this worker does not hold it and return False."""
        try:
            self.engine.put_under_adapter(seq, lora_name)
        except ValueError as exc:
            self.fail(seq.request_id, str(exc), retryable=False)
            return False
        return True

    def admit(self, seq: Sequence) -> bool:
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            self.fail(seq.request_id, str(exc), retryable=False)
            return False
        return True

    def fail(self, request_id: str, error: str, retryable: bool) -> None:
        logger.warning("request %s failed: %s", request_id, error)
        self.link.send(RequestFailed(request_id, error, retryable))

    def delta(self, seq: Sequence, num_new: int = 1, first: bool = False) -> TokenDelta:
        """The delta of ``seq``'s ``num_new`` newest tokens (and its finish, if it finished)."""
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        if seq.num_output_tokens == num_new and seq.num_cached_tokens:
            PREFIX_CACHE_HIT_TOKENS.inc(seq.num_cached_tokens)
        return TokenDelta(
            seq.request_id,
            [sample_to_wire(sample) for sample in seq.samples[-num_new:]],
            start_index=seq.num_output_tokens - num_new,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            first=first,
            prompt_logprobs=prompt_logprobs_to_wire(first_output_prompt_logprobs(seq, num_new)),
            timings=stage_times(seq, num_new),
        )

    def send_deltas(self, advanced: Iterable[tuple[Sequence, int]], first: bool = False) -> None:
        """One frame for a step's new tokens, however many sequences the step advanced
        (``advanced``: each with its count of new tokens; ``first``: they are their requests'
        first tokens, from a prefill worker). A lone delta that is more than its token goes as
        itself; one-token deltas with nothing else to say go in ``TokenDeltas``' columns."""
        frame = TokenDeltas()
        add_token = frame.add_token
        for seq, num_new in advanced:
            num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
            if num_new == 1 and not first and _says_only_its_token(seq, num_output_tokens):
                add_token(seq.request_id, seq.token_ids[-1], num_output_tokens - 1)
            else:
                frame.deltas.append(self.delta(seq, num_new, first))
        if len(frame.deltas) == 1 and not frame.token_ids:
            self._send_output(frame.deltas[0])
        elif frame.deltas or frame.token_ids:
            self._send_output(frame)

    def send_token_columns(self, outputs: DecodeOutputs) -> None:
        """``send_deltas`` for a plain decode step's outputs: the rows whose delta is their
        token alone go as the step's token columns, read off the persistent batch
        (``TokenColumns``), the others as deltas of their own."""
        columns = outputs.columns
        frame = TokenDeltas(
            [self.delta(outputs[row].seq) for row in columns.full_rows],
            columns.request_ids,
            columns.token_ids,
            columns.start_indices,
        )
        if len(frame.deltas) == 1 and not frame.token_ids:
            self._send_output(frame.deltas[0])
        elif frame.deltas or frame.token_ids:
            self._send_output(frame)

    def _send_output(self, msg: Message) -> None:
        """Send what a step produced: at once, or (``output_beside_forward``) encoded and sent
        by the step helper while the next forward runs, or at the turn's end if none follows."""
        if self.output_beside_forward:
            self.link.send_soon(msg)
        else:
            self.link.send(msg)

    def base_registration(self, **extra) -> RegisterWorker:
        return RegisterWorker(
            protocol_version=PROTOCOL_VERSION,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            role=self.role,
            model=self.engine.model_path.name,
            kv_layout=self.engine.kv_layout,
            kv_transfer=self.args.kv_transfer,
            num_pages=self.page_manager.num_pages,
            max_model_len=self.engine.max_model_len,
            metrics_url=self.metrics_url,
            deterministic=self.engine.config.enable_deterministic_inference,
            **extra,
        )

    def close_role(self) -> None:  # noqa: B027 (a role without sockets of its own)
        """Close the role's own sockets (not the host's): at exit, or once a role switch has
        built the next role."""

    def close(self) -> None:
        self.close_role()
        self.host.close()


def add_role_args(parser: argparse.ArgumentParser) -> None:
    """Both roles' own flags, which every worker takes: the role it may switch to reads its
    own from them."""
    parser.add_argument(
        "--role-switch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let the router switch this worker to the other role live, keeping its weights "
        "and KV pool (POST /v1/workers/{id}/role)",
    )
    prefill = parser.add_argument_group("prefill role")
    prefill.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="how long shipped pages stay pinned waiting for the decode worker",
    )
    prefill.add_argument(
        "--ship-chunks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ship a long prompt's pages after each chunk, while the next computes",
    )
    decode = parser.add_argument_group("decode role")
    decode.add_argument(
        "--kv-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a handoff's pages before prefilling the prompt here",
    )


def worker_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_worker_args(parser)
    add_role_args(parser)
    return parser


def run_worker(
    service_class: type[WorkerService],
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    roles: Mapping[str, type[WorkerService]] | None = None,
) -> int:
    """Run a ``service_class`` worker until it exits; ``roles``: the worker class of each role
    it may switch to live (its own included)."""
    prog = parser.prog
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        worker = service_class(args)
    except ValueError as exc:
        logging.getLogger(prog).error("%s", exc)
        return 2
    if roles is not None:
        worker.roles = {**roles, worker.role: service_class}
    try:
        with startup_objects_frozen():  # the imports and the model: no collection walks them
            current: WorkerService | None = worker
            while current is not None:
                current.serve()
                current = current.successor  # a role switch: the loop goes on in the new role
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError) as exc:
        logging.getLogger(prog).error("%s", exc)
        return 1
    return 0
