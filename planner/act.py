"""How the planner's changes happen: actuators.

- ``RouterRoleSwitch``: a running worker changes role, through the router's ``POST
  /v1/workers/{id}/role`` (seconds: no weights loaded, no pod started). The one every planner
  has.
- ``LocalWorkers``: ``pdserve up --planner`` starts and stops worker processes through the
  launcher, which hands the planner its ``WorkerLauncher``.
- ``KubernetesScale``: the floors (``minReplicas``) of the prefill and decode pools'
  HorizontalPodAutoscalers, through the Kubernetes API (``deploy/kubernetes/overlays/planner``).

Contract: ``apply`` is called from the planner's loop alone, with the observation the decision
was made on; it starts the change and returns at once, saying what it did, or raises
``ActuationError`` (nothing changed). ``pending`` says, per role, how many workers a change it
started will add (negative: remove) that the router does not show yet, so the next decision
counts them.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

from planner.decide import DECODE, PREFILL, Change
from planner.observe import Observation, RouterClient, WorkerView

logger = logging.getLogger(__name__)


class ActuationError(RuntimeError):
    """A change that could not be started; nothing changed."""


class Actuator(ABC):
    can_switch = False
    can_scale = False

    @abstractmethod
    def apply(self, change: Change, seen: Observation) -> str: ...

    def pending(self, seen: Observation) -> dict[str, int]:
        return {PREFILL: 0, DECODE: 0}


def _spare(
    seen: Observation, role: str, skip: frozenset[str] | set[str] = frozenset()
) -> WorkerView:
    """The least loaded worker serving ``role`` that is neither switching nor draining."""
    candidates = [
        w
        for w in seen.workers
        if w.role == role and w.switching_to is None and not w.draining and w.worker_id not in skip
    ]
    if not candidates:
        raise ActuationError(f"no {role} worker free to change")
    return min(candidates, key=lambda w: (w.inflight, w.worker_id))


class RouterRoleSwitch(Actuator):
    """Role switches through the router. A switch in flight shows in ``GET /v1/workers`` as the
    worker's ``switching``, which the observation counts already: nothing pending here."""

    can_switch = True

    def __init__(self, client: RouterClient, drain_timeout_s: float = 30.0) -> None:
        self.client = client
        self.drain_timeout_s = drain_timeout_s

    def apply(self, change: Change, seen: Observation) -> str:
        if change.action != "switch":
            raise ActuationError(f"role switches cannot {change.action} a worker")
        donor = DECODE if change.role == PREFILL else PREFILL
        worker = _spare(seen, donor)
        status, body = self.client.post(
            f"/v1/workers/{worker.worker_id}/role",
            {"role": change.role, "drain_timeout_s": self.drain_timeout_s, "wait": False},
        )
        if status not in (200, 202):
            message = body.get("error", {}).get("message") if isinstance(body, dict) else body
            raise ActuationError(f"switch of {worker.worker_id} refused: HTTP {status} {message}")
        return f"switching {worker.worker_id} from {donor} to {change.role}"


class WorkerLauncher(Protocol):
    """What ``pdserve up`` lends the planner: start a worker of a role (returns its worker id),
    stop one by id (it drains first)."""

    def start(self, role: str) -> str: ...

    def stop(self, worker_id: str) -> None: ...


class LocalWorkers(Actuator):
    """Workers started and stopped as local processes, within ``max_workers``."""

    can_scale = True

    def __init__(self, launcher: WorkerLauncher, start_timeout_s: float = 300.0) -> None:
        self.launcher = launcher
        self.start_timeout_s = start_timeout_s
        self._starting: dict[str, tuple[str, float]] = {}  # worker id -> (role, since)
        self._stopping: dict[str, tuple[str, float]] = {}

    def apply(self, change: Change, seen: Observation) -> str:
        if change.action == "add":
            worker_id = self.launcher.start(change.role)
            self._starting[worker_id] = (change.role, time.monotonic())
            return f"started {change.role} worker {worker_id}"
        if change.action == "remove":
            worker = _spare(seen, change.role, skip=set(self._stopping))
            self.launcher.stop(worker.worker_id)
            self._stopping[worker.worker_id] = (change.role, time.monotonic())
            return f"stopping {change.role} worker {worker.worker_id}"
        raise ActuationError(f"local workers cannot {change.action} a worker")

    def pending(self, seen: Observation) -> dict[str, int]:
        listed = {w.worker_id for w in seen.workers}
        now = time.monotonic()
        # Started until registered (or given up on); stopping until the router lets it go.
        for worker_id, (_, since) in list(self._starting.items()):
            if worker_id in listed or now - since > self.start_timeout_s:
                del self._starting[worker_id]
        for worker_id, (_, since) in list(self._stopping.items()):
            if worker_id not in listed or now - since > self.start_timeout_s:
                del self._stopping[worker_id]
        counts = {PREFILL: 0, DECODE: 0}
        for role, _ in self._starting.values():
            counts[role] += 1
        for role, _ in self._stopping.values():
            counts[role] -= 1
        return counts


# The in-cluster service account's files (a Pod's).
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesScale(Actuator):
    """The prefill and decode pools on Kubernetes, through their HorizontalPodAutoscalers: the
    planner sets each one's ``minReplicas``, the floor it scales from (``PATCH
    /apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/{name}``; RBAC: ``get`` and
    ``patch`` on those two, ``deploy/kubernetes/overlays/planner``). The autoscaler stays the
    one owner of the Deployments' replicas, so the two never fight: it adds workers on its own
    metric above the planner's floor, and removes one only when its metric lets it, below
    ``maxReplicas``, which bounds the planner too. A worker asked for and not yet registered
    with the router is pending."""

    can_scale = True

    def __init__(
        self,
        api_url: str | None = None,
        namespace: str | None = None,
        autoscalers: dict[str, str] | None = None,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = 10.0,
    ) -> None:
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not in a Kubernetes Pod: give --kubernetes-api")
            api_url = f"https://{host}:{port}"
        self.api_url = api_url.rstrip("/")
        if namespace is None:
            path = SERVICE_ACCOUNT / "namespace"
            namespace = path.read_text().strip() if path.is_file() else "default"
        self.namespace = namespace
        self.autoscalers = autoscalers or {PREFILL: "pdserve-prefill", DECODE: "pdserve-decode"}
        token_file = token_file or SERVICE_ACCOUNT / "token"
        self.token = token_file.read_text().strip() if token_file.is_file() else None
        ca_file = ca_file or SERVICE_ACCOUNT / "ca.crt"
        self.context = (
            ssl.create_default_context(cafile=str(ca_file))
            if self.api_url.startswith("https") and ca_file.is_file()
            else None
        )
        self.timeout = timeout

    def _call(self, method: str, role: str, body: dict | None = None) -> dict:
        name = self.autoscalers[role]
        url = (
            f"{self.api_url}/apis/autoscaling/v2/namespaces/{self.namespace}"
            f"/horizontalpodautoscalers/{name}"
        )
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200]
            raise ActuationError(f"{method} {name}: HTTP {exc.code} {detail!r}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ActuationError(f"{method} {name}: {exc}") from exc

    def bounds(self, role: str) -> tuple[int, int]:
        """The autoscaler's (minReplicas, maxReplicas)."""
        spec = self._call("GET", role).get("spec", {})
        return int(spec.get("minReplicas", 1)), int(spec.get("maxReplicas", 1))

    def apply(self, change: Change, seen: Observation) -> str:
        if change.action not in ("add", "remove"):
            raise ActuationError(f"autoscalers cannot {change.action} a worker")
        floor, ceiling = self.bounds(change.role)
        registered = sum(1 for w in seen.workers if w.role == change.role)
        # From what serves now: a floor below it would not remove a worker.
        wanted = max(registered, floor) + 1 if change.action == "add" else registered - 1
        if not 1 <= wanted <= ceiling:
            raise ActuationError(
                f"{self.autoscalers[change.role]}: {wanted} replicas is outside 1..{ceiling}"
            )
        self._call("PATCH", change.role, {"spec": {"minReplicas": wanted}})
        name = self.autoscalers[change.role]
        return f"set {name}'s minReplicas from {floor} to {wanted}"

    def pending(self, seen: Observation) -> dict[str, int]:
        counts = {}
        for role in (PREFILL, DECODE):
            try:
                floor, _ = self.bounds(role)
            except ActuationError as exc:
                logger.warning("cannot read the %s autoscaler: %s", role, exc)
                counts[role] = 0
                continue
            registered = sum(1 for w in seen.workers if w.role == role)
            counts[role] = max(0, floor - registered)
        return counts
