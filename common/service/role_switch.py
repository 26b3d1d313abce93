"""A worker's live role switch: what a worker does between the router's ``SwitchRole`` and its
``RoleSwitchResult``.

The router has stopped routing to the worker before it sends ``SwitchRole`` (and, for a decode
worker, waited until nothing was on its way to it). The worker then:

1. refuses at once what it cannot do (``switch_problem``): it answers ``SWITCH_REFUSED`` and goes
   on as it was;
2. serves what it holds, in its old role, as a drain does (``common/service/drain.py``; the
   drain's ``num_held`` is the measure): a prefill worker its queued prompts and its handoffs
   until their decode workers have fetched the pages, a decode worker its sequences;
3. once it holds nothing and no page of its pool is in use (cached free pages stay cached),
   builds the new role around the same engine (``LLMEngine.set_role``: a new scheduler over the
   same page manager) and the new role's sockets (a prefill worker's KV sender, a decode
   worker's handoff socket and KV receiver), then closes the old role's;
4. registers again, same worker id and incarnation, in the new role, and answers
   ``SWITCH_SWITCHED``.

If the drain outlasts the switch's timeout, or building the new role raises, the old role is
left as it was (its scheduler and sockets were never closed) and the worker answers
``SWITCH_FAILED``: it serves its old role still, and the router routes to it again. SIGTERM
during a switch wins: the worker drains and leaves as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.protocol import (
    SWITCH_FAILED,
    SWITCH_SWITCHED,
    RoleSwitchResult,
    SwitchRole,
)


class RoleSwitch:
    """One switch under way in a worker (``SwitchRole`` received, not answered yet)."""

    def __init__(
        self, order: SwitchRole, from_role: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.operation_id = order.operation_id
        self.role = order.role
        self.from_role = from_role
        self.clock = clock
        self.started_at = clock()
        self.deadline = self.started_at + order.drain_timeout_s

    def timed_out(self) -> bool:
        return self.clock() >= self.deadline

    def switched(self, worker_id: str) -> RoleSwitchResult:
        return RoleSwitchResult(worker_id, self.operation_id, self.role, SWITCH_SWITCHED)

    def failed(self, worker_id: str, error: str) -> RoleSwitchResult:
        return RoleSwitchResult(worker_id, self.operation_id, self.from_role, SWITCH_FAILED, error)


def switch_problem(
    role: str,
    current_role: str,
    *,
    allowed: bool,
    buildable: bool,
    tensor_parallel_size: int,
    speculative: bool,
    draining: bool,
    switching: bool,
) -> str | None:
    """Why a worker serving ``current_role`` will not start becoming ``role``, or None.

    ``allowed``: it was started with ``--role-switch``; ``buildable``: its process knows the
    ``role`` worker class; ``speculative``: it is configured to decode speculatively (its pool
    was sized for a draft model a prefill worker never loads, and the reverse)."""
    if role == current_role:
        return f"it serves as {role} already"
    if not allowed:
        return "it was started with --no-role-switch"
    if not buildable:
        return f"its process cannot build a {role} worker"
    if tensor_parallel_size > 1:
        return "a worker over tensor-parallel ranks keeps its role"
    if speculative:
        return "a worker configured for speculative decoding keeps its role"
    if draining:
        return "it is draining"
    if switching:
        return "it is switching already"
    return None
