"""``pdserve decode``: a decode worker, which the router may switch to a prefill worker live
(common/service/role_switch.py)."""

from __future__ import annotations

from common.service.worker_base import WorkerService, run_worker
from decode_worker.worker import DecodeWorker, build_parser
from prefill_worker.worker import PrefillWorker

# Each role's worker class: what a role switch builds.
ROLES: dict[str, type[WorkerService]] = {"prefill": PrefillWorker, "decode": DecodeWorker}


def main(argv: list[str] | None = None) -> int:
    return run_worker(DecodeWorker, build_parser(), argv, roles=ROLES)
