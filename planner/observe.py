"""What the planner sees, read from the router's HTTP interface alone: ``GET /v1/workers`` (each
worker's role, whether it is switching or draining, its load and its steps summed) and ``GET
/v1/traffic`` (recent arrivals and finished sequences).

``Observer.observe`` turns two readings into each worker's mean step of the span between (fed to
its pool's ``StepCostFitter``) and the traffic of the window: arrivals per second, their prompt
lengths, and the output they are expected to generate (their ``max_tokens``, or, once sequences
end by a stop rather than by their limit, the mean output of those that finished).
"""

from __future__ import annotations

import json
import logging
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from planner.fit import StepCostFitter, StepSample
from planner.predict import Traffic

logger = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"
# Prompt lengths kept per observation: enough for the prediction's mean over them.
MAX_PROMPTS = 256


class RouterUnreachable(RuntimeError):
    """The router did not answer, or answered what is not its JSON."""


class RouterClient:
    """The router's HTTP interface: JSON in and out, with its API key."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"{}")
            except ValueError:
                return exc.code, {}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RouterUnreachable(f"{method} {self.base_url}{path}: {exc}") from exc

    def get(self, path: str) -> dict:
        status, body = self._request("GET", path, None)
        if status != 200:
            raise RouterUnreachable(f"GET {path}: HTTP {status} {body}")
        return body

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        return self._request("POST", path, body)


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: str
    switching_to: str | None
    draining: bool
    inflight: int

    @property
    def settled_role(self) -> str:
        """The role it will serve once its switch lands (pending changes counted)."""
        return self.switching_to or self.role


@dataclass(frozen=True, slots=True)
class Observation:
    workers: tuple[WorkerView, ...]
    traffic: Traffic
    finished: int  # sequences finished in the window
    ttft_s: tuple[float, ...] = ()  # theirs, for the observed attainment
    tpot_s: tuple[float, ...] = ()

    def count(self, role: str) -> int:
        """Workers of ``role`` once the switches in flight land (draining ones not counted)."""
        return sum(1 for w in self.workers if w.settled_role == role and not w.draining)

    @property
    def switching(self) -> int:
        return sum(1 for w in self.workers if w.switching_to is not None)

    def attained(self, slo_ttft_s: float, slo_itl_s: float) -> float | None:
        """The share of the window's finished sequences that met both SLOs (None: none)."""
        if not self.ttft_s:
            return None
        met = sum(
            1
            for ttft, tpot in zip(self.ttft_s, self.tpot_s, strict=True)
            if ttft <= slo_ttft_s and tpot <= slo_itl_s
        )
        return met / len(self.ttft_s)


@dataclass(slots=True)
class Observer:
    client: RouterClient
    fitters: dict[str, StepCostFitter]
    window_s: float = 30.0
    # Each worker's steps summed at the previous reading: (role, count, seconds, tokens, rows).
    _last: dict[str, tuple[str, int, float, int, int]] = field(default_factory=dict)

    def observe(self) -> Observation:
        listing = self.client.get("/v1/workers")
        traffic = self.client.get(f"/v1/traffic?window_s={self.window_s:g}")
        workers = []
        for role in (PREFILL, DECODE):
            for entry in listing.get(role, []):
                workers.append(self._worker(entry, role))
        return Observation(tuple(workers), *self._traffic(traffic))

    def _worker(self, entry: dict, role: str) -> WorkerView:
        switching = entry.get("switching")
        view = WorkerView(
            worker_id=str(entry["id"]),
            role=role,
            switching_to=switching.get("to") if isinstance(switching, dict) else None,
            draining=bool(entry.get("draining")),
            inflight=int(entry.get("load", {}).get("inflight", 0)),
        )
        steps = entry.get("steps") or {}
        now = (
            role,
            int(steps.get("count", 0)),
            float(steps.get("busy_seconds", 0.0)),
            int(steps.get("tokens", 0)),
            int(steps.get("rows", 0)),
        )
        before = self._last.get(view.worker_id)
        self._last[view.worker_id] = now
        # A span within one role, with steps in it: its mean step. A count that went back is
        # a restarted worker, a span across a role switch is two pools' steps: neither is one.
        if before is not None and before[0] == role and now[1] > before[1]:
            count = now[1] - before[1]
            seconds = now[2] - before[2]
            tokens, rows = now[3] - before[3], now[4] - before[4]
            sample = StepSample(tokens / count, rows / count, seconds / count, count)
            if self.fitters[role].observe(sample) is False:
                logger.debug("worker %s: unusable step figures %s", view.worker_id, sample)
        return view

    def _traffic(self, body: dict) -> tuple[Traffic, int, tuple[float, ...], tuple[float, ...]]:
        window = float(body.get("window_s", self.window_s)) or self.window_s
        arrivals = body.get("arrivals", [])
        finished = body.get("finished", [])
        prompts = tuple(int(a["prompt_tokens"]) for a in arrivals[-MAX_PROMPTS:])
        limits = [int(a["max_tokens"]) for a in arrivals]
        output = sum(limits) / len(limits) if limits else 0.0
        stopped = [int(f["output_tokens"]) for f in finished if f.get("reason") == "stop"]
        if stopped and finished:
            output = sum(int(f["output_tokens"]) for f in finished) / len(finished)
        complete = [f for f in finished if f.get("reason") in ("stop", "length")]
        traffic = Traffic(len(arrivals) / window, prompts, output if math.isfinite(output) else 0)
        return (
            traffic,
            len(finished),
            tuple(float(f["ttft_s"]) for f in complete),
            tuple(float(f["tpot_s"]) for f in complete),
        )
