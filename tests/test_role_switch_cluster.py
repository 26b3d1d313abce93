"""Live role switches on real worker processes (the tiny model): under a stream of requests
through the router, a prefill worker becomes a decode worker and a decode worker a prefill
worker while each holds requests (another worker of each role stays up, so the cluster keeps
serving); every request is answered with the one-process engine's greedy tokens, the switched
workers serve in their new roles, and every page of every pool is free afterwards. A worker
started with ``--no-role-switch`` refuses its switch and serves on in its role.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from test_drain import PROMPT, Cluster, complete, greedy_answers
from tiny_models import build_tiny_chat_model

from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts a router and four workers

MAX_JOBS = 120
# (worker, new role, the rest of the body): both ways, each drain whole. (A drain cut short
# moves what is left as a leave does, which tests/test_drain.py runs on real workers.)
SWITCHES = (
    ("prefill-1", "decode", {"drain_timeout_s": 120}),
    ("decode-1", "prefill", {"drain_timeout_s": 120}),
)
FINAL = {"prefill": {"prefill-0", "decode-1"}, "decode": {"decode-0", "prefill-1"}}


class Switcher(threading.Thread):
    """Switches the worker of each of SWITCHES once it is busy, one after the other, each
    waited for through ``POST /v1/workers/{id}/role``; then waits for both switched workers to
    be busy in their last roles. Busy: a prefill worker was just sent a prompt or has prompt
    tokens queued, a decode worker holds a request (the router's books); ``busy`` records each
    (worker, the role it was busy in), so shows the router routing to it in its new role."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(name="role-switcher", daemon=True)
        self.cluster = cluster
        self.answers: list[httpx.Response] = []
        self.busy: list[tuple[str, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for worker_id, role, body in SWITCHES:
                self._wait_busy(worker_id)
                self.answers.append(
                    httpx.post(
                        f"{self.cluster.base}/v1/workers/{worker_id}/role",
                        json={"role": role, **body},
                        timeout=200,
                    )
                )
            for worker_id in ("decode-1", "prefill-1"):
                self._wait_busy(worker_id)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _wait_busy(self, worker_id: str, deadline_s: float = 120) -> None:
        """Until ``worker_id`` is busy (see the class), then note it in ``busy``."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            listing = self.cluster.workers()
            entry = [w for role in listing.values() for w in role if w["id"] == worker_id]
            load = entry[0]["load"] if entry else None
            if load and (
                load["dispatched_unreported"] + load["queued_prefill_tokens"]
                if entry[0]["role"] == "prefill"
                else load["inflight"]
            ):
                self.busy.append((worker_id, entry[0]["role"]))
                return
            time.sleep(0.01)
        raise AssertionError(f"{worker_id} never got a request")


def whole_log(cluster: Cluster, name: str) -> str:
    return (cluster.logs / f"{name}.log").read_text()


def switch_report(cluster: Cluster, worker_id: str) -> list[int]:
    """From the worker's log: the requests it held when told to switch, at each switch."""
    found = re.findall(r"switching from \w+ to \w+: (\d+) requests", whole_log(cluster, worker_id))
    assert found, cluster.log(worker_id)
    return [int(count) for count in found]


def test_workers_switch_roles_both_ways_under_a_stream_of_requests(tmp_path: Path):
    folder = build_tiny_chat_model(tmp_path / "tiny-chat")
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(folder, logs)
    with ExitStack() as stack:
        stack.callback(cluster.stop)
        for index in range(2):
            # prefill-0 may not change role: a switch of it is refused, and it serves on.
            keep = ["--no-role-switch"] if index == 0 else []
            cluster.start_worker(f"prefill-{index}", "prefill", "--max-num-batched-tokens", "8",
                                 *keep)  # fmt: skip
            cluster.start_worker(f"decode-{index}", "decode")
        cluster.wait_for(prefill=2, decode=2)
        tokenizer = Tokenizer(folder)

        def job(i: int) -> tuple[str, int]:
            """(prompt, max_tokens): every fifth a longer generation, the rest short."""
            if i % 5 == 0:
                return f"request {i}: {PROMPT}", 128
            return f"request {i}: {PROMPT * (1 + i % 3)}", 16

        switcher = Switcher(cluster)
        jobs: list[tuple[str, int]] = []
        after_switches = 0
        with ThreadPoolExecutor(max_workers=MAX_JOBS) as pool:
            futures = []
            # Eight requests a second until both switches are done and eight more have come
            # after them, for the workers in their new roles.
            while after_switches < 8:
                assert len(jobs) < MAX_JOBS, "the switches did not end"
                jobs.append(job(len(jobs)))
                futures.append(pool.submit(complete, cluster.base, jobs[-1]))
                time.sleep(0.125)
                if len(jobs) == 4:
                    switcher.start()
                if len(jobs) > 4 and not switcher.is_alive():
                    if not after_switches:
                        refused = httpx.post(f"{cluster.base}/v1/workers/prefill-0/role",
                                             json={"role": "decode"}, timeout=60)  # fmt: skip
                    after_switches += 1
            results = [future.result(timeout=300) for future in futures]
        switcher.join(timeout=10)
        assert switcher.error is None, switcher.error

        for (worker_id, role, _), answer in zip(SWITCHES, switcher.answers, strict=True):
            assert answer.status_code == 200, (answer.text, cluster.log(worker_id))
            body = answer.json()
            assert (body["status"], body["to"]) == ("switched", role), body
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "role_switch_refused"
        assert "--no-role-switch" in refused.json()["error"]["message"]
        listing = cluster.workers()
        pools = {role: {w["id"] for w in listing[role]} for role in ("prefill", "decode")}
        assert pools == FINAL

        # Every answer is the one-process engine's.
        expected = greedy_answers(folder, tokenizer, jobs)
        assert [r["finish_reason"] for r in results] == ["length"] * len(jobs)
        for i, (result, tokens) in enumerate(zip(results, expected, strict=True)):
            assert result["text"] == tokenizer.decode(tokens), i

        # The switched workers were routed to in each of their new roles.
        assert switcher.busy == [
            ("prefill-1", "prefill"),
            ("decode-1", "decode"),
            ("decode-1", "prefill"),
            ("prefill-1", "decode"),
        ]
        # And every page of every pool is free again (their heartbeats say so within a second).
        deadline = time.monotonic() + 60
        while True:
            listing = cluster.workers()
            busy = {w["id"]: w["num_pages"] - w["num_free_pages"]
                    for role in listing.values() for w in role}  # fmt: skip
            if not any(busy.values()):
                break
            assert time.monotonic() < deadline, f"pages still in use: {busy}"
            time.sleep(0.2)
        metrics = httpx.get(f"{cluster.base}/metrics", timeout=10).text
        for direction, count in (("prefill_to_decode", 1), ("decode_to_prefill", 1)):
            line = (
                f'pdserve_router_role_switches_total{{direction="{direction}",'
                f'outcome="switched"}} {count:.1f}'
            )
            assert line in metrics, metrics
        # Nothing was lost on the way and found again by the router's stall timeout, nor moved
        # off a worker: every request finished where it was first sent.
        for name in ("stalled_requests", "redispatches"):
            pattern = rf"^pdserve_router_{name}_total(?:{{[^}}]*}})? (\S+)$"
            found = re.findall(pattern, metrics, re.M)
            assert sum(float(v) for v in found) == 0, (name, found)
        for name, process in cluster.processes.items():
            assert process.poll() is None, f"{name} exited:\n{cluster.log(name)}"
        took = [(wid, to, json.loads(a.text)["duration_s"])
                for (wid, to, _), a in zip(SWITCHES, switcher.answers, strict=True)]  # fmt: skip
        # How many requests each held when told to switch: timing decides (a decode worker is
        # told once the router has nothing on it, so it holds none by then).
        held = [switch_report(cluster, wid) for wid, _, _ in SWITCHES]
        print(f"{len(jobs)} requests; switches (worker, to, seconds): {took}; held when told: "
              f"{held}")  # fmt: skip
