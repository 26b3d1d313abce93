"""Live role switches: a registered worker becomes a prefill or a decode worker, keeping its
weights and its KV pool (``POST /v1/workers/{id}/role``, and the planner through ``RoleSwitches``).

The router's part of a switch, on its event loop:

1. refuse at once what cannot be done (an unknown or draining worker, one already switching, a
   role unknown, the last decode worker; a switch to the role it serves is done already);
2. mark the worker switching: nothing new is routed to it from now on;
3. a decode worker: wait until the router's books show nothing on it. Handoffs may still be on
   their way to it from prefill workers until then, which only the router knows of; a prefill
   worker is told at once (what it holds came from the router, on the socket ``SwitchRole``
   follows);
4. send ``SwitchRole``: the worker finishes what it holds, builds the new role around its
   engine, registers again under the same id (``Dispatcher`` hands that to
   ``WorkerRegistry.change_role``) and answers ``RoleSwitchResult``;
5. unmark it. A switch that ran out of time, or that the worker refused or failed, leaves it
   serving in its old role.

Every switch ends counted (``pdserve_router_role_switches_total``) and, once done, timed
(``pdserve_router_role_switch_seconds``), and the worker's ``last_role_switch`` in
``GET /v1/workers`` says how it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from common.messages import Message
from common.protocol import (
    MAX_SWITCH_DRAIN_S,
    ROLE_DECODE,
    ROLE_PREFILL,
    SWITCH_FAILED,
    SWITCH_REFUSED,
    SWITCH_SWITCHED,
    RoleSwitchResult,
    SwitchRole,
)
from router.edge import body_schema
from router.errors import APIError
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.state import RouterState

logger = logging.getLogger(__name__)

# How long a switch may take to drain its worker unless the caller says.
DEFAULT_SWITCH_DRAIN_S = 30.0
# Beyond the drain: for the worker to build its new role and register again.
_ANSWER_SLACK_S = 15.0
_POLL_S = 0.02
# After its requests moved off: for the worker to read their aborts and free their pages.
_AFTER_MIGRATION_S = 10.0
# ``status`` of an answer: a switch done, or the role served already (nothing to do).
STATUS_SWITCHED = SWITCH_SWITCHED
STATUS_UNCHANGED = "unchanged"
STATUS_SWITCHING = "switching"  # accepted, not waited for (``wait: false``)


class SwitchFailed(APIError):
    """A switch that started and did not happen (the drain ran out of time, the worker failed
    to build its new role or left meanwhile): the worker serves its old role still."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message, None, "role_switch_failed")


@dataclass(slots=True)
class SwitchOutcome:
    """What a switch came to: ``status`` is ``STATUS_*``."""

    operation_id: str | None
    worker_id: str
    from_role: str
    to_role: str
    status: str
    duration_s: float = 0.0

    def describe(self) -> dict:
        return {
            "object": "worker.role_switch",
            "id": self.operation_id,
            "worker_id": self.worker_id,
            "from": self.from_role,
            "to": self.to_role,
            "status": self.status,
            "duration_s": round(self.duration_s, 3),
        }


@dataclass(slots=True)
class _Switch:
    operation_id: str
    worker_id: str
    from_role: str
    to_role: str
    started_at: float
    # A decode worker still holding requests at the drain timeout: move them to other decode
    # workers and switch (True), or give up the switch (False).
    migrate: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: RoleSwitchResult | None = None


class RoleSwitches:
    """The switches under way. Runs on the router's event loop, as the control socket does:
    ``begin`` refuses or starts a switch, ``finish`` waits for it to end."""

    def __init__(
        self,
        registry: WorkerRegistry,
        send: Callable[[str, Message], None],
        metrics: RouterMetrics,
        settled: Callable[[], None] = lambda: None,
        move_off: Callable[[str], int] = lambda worker_id: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``settled``: called when a switch ends (its worker takes requests again, in one
        role or the other), to dispatch what waits for a worker; ``move_off``: moves every
        request the router has on a worker to others (``Dispatcher.move_off``), returning how
        many."""
        self.registry = registry
        self.send = send
        self.metrics = metrics
        self.settled = settled
        self.move_off = move_off
        self.clock = clock
        self._ids = itertools.count()
        self._open: dict[str, _Switch] = {}  # operation id -> switch
        self.tasks: set[asyncio.Task] = set()  # switches not waited for by their caller

    def begin(self, worker_id: str, role: str, migrate: bool = False) -> _Switch | SwitchOutcome:
        """Start switching ``worker_id`` to ``role``, or raise the ``APIError`` that refuses it;
        a worker serving ``role`` already gives its ``STATUS_UNCHANGED`` outcome. ``migrate``:
        a decode worker's requests left at the drain timeout move to other decode workers (with
        their tokens so far, as when a worker leaves) rather than failing the switch."""
        state = self.registry.workers.get(worker_id)
        if state is None:
            raise APIError(404, f"no worker {worker_id!r} is registered", None, "worker_not_found")
        if role not in (ROLE_PREFILL, ROLE_DECODE):
            raise APIError(400, f"unknown role {role!r}", "role", "invalid_role")
        if state.switching_to is not None:
            raise APIError(
                409,
                f"worker {worker_id} is switching to {state.switching_to} already",
                None,
                "role_switch_in_progress",
            )
        if state.role == role:
            return SwitchOutcome(None, worker_id, role, role, STATUS_UNCHANGED)
        if state.draining:
            raise APIError(409, f"worker {worker_id} is draining", None, "worker_draining")
        if state.role == ROLE_DECODE and not any(
            w.serving and w.worker_id != worker_id for w in self.registry.pool(ROLE_DECODE)
        ):
            self._count(state.role, role, SWITCH_REFUSED)
            raise APIError(
                409,
                f"worker {worker_id} is the last decode worker serving: switching it would "
                "leave no worker to decode",
                None,
                "last_decode_worker",
            )
        switch = _Switch(
            f"switch-{next(self._ids)}", worker_id, state.role, role, self.clock(), migrate
        )
        state.switching_to, state.switching_since = role, switch.started_at
        self._open[switch.operation_id] = switch
        logger.info(
            "worker %s switches from %s to %s (%s): nothing new is routed to it",
            worker_id,
            state.role,
            role,
            switch.operation_id,
        )
        return switch

    async def finish(self, switch: _Switch, drain_timeout_s: float) -> SwitchOutcome:
        """Drain and switch (steps 3 to 5 of the module's docstring); the outcome, or the
        ``APIError`` saying why the worker still serves its old role."""
        try:
            result = await self._run(switch, drain_timeout_s)
        finally:
            self._open.pop(switch.operation_id, None)
            state = self.registry.workers.get(switch.worker_id)
            if state is not None and state.switching_to == switch.to_role:
                state.switching_to = state.switching_since = None
            self.settled()
        took = self.clock() - switch.started_at
        outcome = result.outcome if result is not None else SWITCH_FAILED
        self._count(switch.from_role, switch.to_role, outcome)
        error = None if result is None else result.error
        if result is None:
            error = (
                f"worker {switch.worker_id} did not switch within "
                f"{drain_timeout_s + _ANSWER_SLACK_S:g} s"
            )
        state = self.registry.workers.get(switch.worker_id)
        if state is not None:
            state.last_role_switch = {
                "id": switch.operation_id,
                "from": switch.from_role,
                "to": switch.to_role,
                "status": outcome,
                "error": error,
                "duration_s": round(took, 3),
            }
        if outcome == SWITCH_SWITCHED:
            self.metrics.role_switch_seconds.labels(_direction(switch)).observe(took)
            logger.info(
                "worker %s switched from %s to %s in %.2f s",
                switch.worker_id,
                switch.from_role,
                switch.to_role,
                took,
            )
            return SwitchOutcome(
                switch.operation_id,
                switch.worker_id,
                switch.from_role,
                switch.to_role,
                STATUS_SWITCHED,
                took,
            )
        logger.warning("worker %s did not switch: %s", switch.worker_id, error)
        if outcome == SWITCH_REFUSED:
            raise APIError(400, str(error), None, "role_switch_refused")
        raise SwitchFailed(f"{error}; worker {switch.worker_id} serves as {switch.from_role}")

    def finish_later(self, switch: _Switch, drain_timeout_s: float) -> None:
        """Finish ``switch`` without a caller waiting: its outcome shows in ``/v1/workers``."""

        async def run() -> None:
            # A failure is logged and recorded as the worker's last_role_switch.
            with contextlib.suppress(APIError):
                await self.finish(switch, drain_timeout_s)

        task = asyncio.get_running_loop().create_task(run(), name=switch.operation_id)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_result(self, sender: str, msg: RoleSwitchResult) -> None:
        """A worker's answer (from the control socket)."""
        switch = self._open.get(msg.operation_id)
        if switch is None or switch.worker_id != sender:
            logger.warning("role switch result %s from %s: no such switch", msg, sender)
            return
        switch.result = msg
        switch.done.set()

    async def _run(self, switch: _Switch, drain_timeout_s: float) -> RoleSwitchResult | None:
        deadline = self.clock() + drain_timeout_s
        if switch.from_role == ROLE_DECODE:
            while (left := self._books(switch)) and self.clock() < deadline:
                await asyncio.sleep(_POLL_S)
            if left is None:
                return self._gone(switch)
            if left and not switch.migrate:
                return self._timed_out(switch, drain_timeout_s, left)
            if left:
                moved = self.move_off(switch.worker_id)
                logger.info("%s: moved %d requests off worker %s at the drain timeout",
                            switch.operation_id, moved, switch.worker_id)  # fmt: skip
                # Their aborts reach the worker before SwitchRole (one socket, in order): it
                # frees their pages at once.
                deadline = self.clock() + _AFTER_MIGRATION_S
        remaining = max(deadline - self.clock(), _POLL_S)
        self.send(switch.worker_id, SwitchRole(switch.operation_id, switch.to_role, remaining))
        answer_by = self.clock() + remaining + _ANSWER_SLACK_S
        while not switch.done.is_set() and self.clock() < answer_by:
            if switch.worker_id not in self.registry.workers:
                return self._gone(switch)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(switch.done.wait(), _POLL_S * 25)
        return switch.result

    def _books(self, switch: _Switch) -> int | None:
        """Requests the router has on the worker; None once the worker is gone."""
        state = self.registry.workers.get(switch.worker_id)
        return None if state is None else len(state.inflight)

    def _gone(self, switch: _Switch) -> RoleSwitchResult:
        return RoleSwitchResult(
            switch.worker_id,
            switch.operation_id,
            switch.from_role,
            SWITCH_FAILED,
            f"worker {switch.worker_id} left during the switch",
        )

    def _timed_out(self, switch: _Switch, drain_timeout_s: float, left: int) -> RoleSwitchResult:
        return RoleSwitchResult(
            switch.worker_id,
            switch.operation_id,
            switch.from_role,
            SWITCH_FAILED,
            f"drain timeout: {left} requests still on worker {switch.worker_id} after "
            f"{drain_timeout_s:g} s",
        )

    def _count(self, from_role: str, to_role: str, outcome: str) -> None:
        self.metrics.role_switches.labels(f"{from_role}_to_{to_role}", outcome).inc()


def _direction(switch: _Switch) -> str:
    return f"{switch.from_role}_to_{switch.to_role}"


class RoleBody(BaseModel):
    """``POST /v1/workers/{id}/role``'s body."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    # How long the worker may take to finish what it holds; past it the switch fails and the
    # worker serves its old role still.
    drain_timeout_s: float = Field(default=DEFAULT_SWITCH_DRAIN_S, gt=0, le=MAX_SWITCH_DRAIN_S)
    # False: answer 202 at once; ``GET /v1/workers`` shows the switch (``switching``) and then
    # its outcome (``last_role_switch``).
    wait: bool = True
    # What a decode worker's requests still there at the drain timeout come to: "fail" the
    # switch (the worker serves them on, in its old role), or "migrate" them to other decode
    # workers with their tokens so far and switch.
    on_timeout: Literal["fail", "migrate"] = "fail"


def add_routes(app: FastAPI, state: RouterState, switches: RoleSwitches) -> None:
    edge = state.edge

    @app.post("/v1/workers/{worker_id}/role", openapi_extra=body_schema(RoleBody))
    async def switch_role(worker_id: str, request: Request) -> Response:
        edge.authorize(request)
        body = await edge.read_body(request, RoleBody)
        started = switches.begin(worker_id, body.role, migrate=body.on_timeout == "migrate")
        if isinstance(started, SwitchOutcome):
            return JSONResponse(started.describe())
        if not body.wait:
            switches.finish_later(started, body.drain_timeout_s)
            accepted = SwitchOutcome(
                started.operation_id,
                worker_id,
                started.from_role,
                started.to_role,
                STATUS_SWITCHING,
            )
            return JSONResponse(accepted.describe(), status_code=202)
        outcome = await switches.finish(started, body.drain_timeout_s)
        return JSONResponse(outcome.describe())
