"""`pdserve planner` as a process against a fake router, the actuators against fakes (local
workers, a Kubernetes API server on 127.0.0.1), and the planner's Kubernetes overlay, rendered and
validated offline."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
from kustomize_subset import render

from planner.act import ActuationError, KubernetesScale, LocalWorkers
from planner.decide import DECODE, PREFILL, Change
from planner.observe import Observation, WorkerView
from planner.predict import Traffic
from planner.service import build_parser

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
PLANNER_METRICS = re.findall(
    r"^\| `(pdserve_planner_\w+)` \|",
    (ROOT / "docs/metrics.md").read_text().split("## The planner", 1)[1],
    re.MULTILINE,
)


class Fake:
    """A JSON HTTP server on 127.0.0.1: ``routes`` maps (method, path) to a function of the
    request body giving (status, body); every request is kept in ``calls``."""

    def __init__(self, routes) -> None:
        self.routes = routes
        self.calls: list[tuple[str, str, dict | None, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?")[0]
                fake.calls.append((self.command, self.path, body, dict(self.headers)))
                route = fake.routes.get((self.command, path))
                status, answer = route(body) if route else (404, {"error": "no route"})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _serve

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def fake(routes) -> Iterator[Fake]:
    server = Fake(routes)
    try:
        yield server
    finally:
        server.close()


def worker_entry(worker_id: str, inflight: int = 0, steps: tuple = (0, 0.0, 0, 0)) -> dict:
    count, busy, tokens, rows = steps
    return {
        "id": worker_id,
        "draining": False,
        "switching": None,
        "load": {"inflight": inflight},
        "steps": {"count": count, "busy_seconds": busy, "tokens": tokens, "rows": rows},
    }


def observation(*workers: WorkerView) -> Observation:
    return Observation(tuple(workers), Traffic(0.0, (), 0.0), 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_pdserve_planner_switches_a_worker_through_the_router_and_exports_its_metrics(tmp_path):
    """A router whose one prefill worker is swamped by long prompts: the planner asks it to
    switch the least loaded decode worker to prefill, and says so on its /metrics."""
    now = {"t": 0}

    def workers(_):
        now["t"] += 1
        t = now["t"]
        # Steps of 256 prompt tokens at ~0.26 s each, and decode steps of 4 rows at ~14 ms.
        return 200, {
            "prefill": [worker_entry("p0", 30, (10 * t, 2.6 * t, 2560 * t, 10 * t))],
            "decode": [
                worker_entry("d0", 3, (50 * t, 0.7 * t, 200 * t, 200 * t)),
                worker_entry("d1", 1, (50 * t, 0.7 * t, 200 * t, 200 * t)),
                worker_entry("d2", 2, (50 * t, 0.7 * t, 200 * t, 200 * t)),
            ],
        }

    traffic = {
        "window_s": 10,
        "arrivals": [{"age_s": i, "prompt_tokens": 1500, "max_tokens": 4} for i in range(10)],
        "finished": [],
    }
    switched = threading.Event()

    def switch(body):
        switched.set()
        return 202, {"status": "switching"}

    routes = {
        ("GET", "/v1/workers"): workers,
        ("GET", "/v1/traffic"): lambda _: (200, traffic),
        ("POST", "/v1/workers/d1/role"): switch,
    }
    port = free_port()
    with fake(routes) as router:
        command = [sys.executable, "-m", "pdserve.cli", "planner", "--router", router.url]
        command += ["--slo-ttft-ms", "3000", "--slo-itl-ms", "200", "--planner-interval", "0.3"]
        command += ["--planner-window", "10", "--metrics-port", str(port)]
        log = (tmp_path / "planner.log").open("w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            assert switched.wait(60), (tmp_path / "planner.log").read_text()
            (_, _, body, _) = next(c for c in router.calls if c[0] == "POST")
            assert body == {"role": "prefill", "drain_timeout_s": 30.0, "wait": False}
            # The decision is counted once the actuator has answered: wait for it.
            counted = re.compile(r'^pdserve_planner_decisions_total\{action="switch"\} [1-9]', re.M)
            deadline = time.monotonic() + 30
            text = ""
            while not counted.search(text) and time.monotonic() < deadline:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                text = page.read().decode()
                time.sleep(0.1)
        finally:
            process.terminate()
            process.wait(timeout=30)
    assert counted.search(text), text
    for name in PLANNER_METRICS:
        assert name.removesuffix("_total") in text, name
    logged = (tmp_path / "planner.log").read_text()
    assert "switch prefill: towards" in logged and "switching d1 from decode to prefill" in logged


def test_pdserve_planner_refuses_bad_flags():
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "planner", "--router", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--slo-ttft-ms and --slo-itl-ms" in run.stderr


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []

    def start(self, role: str) -> str:
        worker_id = f"{role}-{len(self.started) + 10}"
        self.started.append(worker_id)
        return worker_id

    def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)


def test_local_workers_count_what_they_started_until_the_router_lists_it():
    launcher = FakeLauncher()
    local = LocalWorkers(launcher)
    seen = observation(
        WorkerView("prefill-0", PREFILL, None, False, 5),
        WorkerView("decode-1", DECODE, None, False, 9),
        WorkerView("decode-2", DECODE, None, False, 2),
    )
    assert local.apply(Change("add", PREFILL), seen) == "started prefill worker prefill-10"
    assert local.pending(seen) == {PREFILL: 1, DECODE: 0}
    # The least loaded decode worker goes; counted gone until the router lets it go.
    assert "decode-2" in local.apply(Change("remove", DECODE), seen)
    assert launcher.stopped == ["decode-2"]
    assert local.pending(seen) == {PREFILL: 1, DECODE: -1}
    later = observation(
        WorkerView("prefill-0", PREFILL, None, False, 5),
        WorkerView("prefill-10", PREFILL, None, False, 0),
        WorkerView("decode-1", DECODE, None, False, 9),
    )
    assert local.pending(later) == {PREFILL: 0, DECODE: 0}
    with pytest.raises(ActuationError):
        local.apply(Change("switch", PREFILL), later)
    with pytest.raises(ActuationError):  # no prefill worker free to go: one is switching
        local.apply(
            Change("remove", PREFILL), observation(WorkerView("p", PREFILL, DECODE, False, 0))
        )


def test_the_kubernetes_actuator_sets_the_autoscalers_floors(tmp_path):
    autoscalers = {"pdserve-prefill": {"minReplicas": 1, "maxReplicas": 3}}
    path = "/apis/autoscaling/v2/namespaces/pdserve/horizontalpodautoscalers/pdserve-prefill"

    def get(_):
        return 200, {"spec": dict(autoscalers["pdserve-prefill"])}

    def patch(body):
        autoscalers["pdserve-prefill"].update(body["spec"])
        return 200, {"spec": dict(autoscalers["pdserve-prefill"])}

    token = tmp_path / "token"
    token.write_text("a-service-account-token\n")
    with fake({("GET", path): get, ("PATCH", path): patch}) as api:
        scale = KubernetesScale(api.url, "pdserve", token_file=token)
        one = observation(WorkerView("p0", PREFILL, None, False, 0))
        assert "from 1 to 2" in scale.apply(Change("add", PREFILL), one)
        assert autoscalers["pdserve-prefill"]["minReplicas"] == 2
        assert scale.pending(one)[PREFILL] == 1  # asked for, not registered yet
        (patched,) = [call for call in api.calls if call[0] == "PATCH"]
        _, _, body, headers = patched
        assert body == {"spec": {"minReplicas": 2}}
        assert headers["Content-Type"] == "application/merge-patch+json"
        assert headers["Authorization"] == "Bearer a-service-account-token"
        three = observation(*(WorkerView(f"p{i}", PREFILL, None, False, 0) for i in range(3)))
        with pytest.raises(ActuationError, match=r"outside 1\.\.3"):
            scale.apply(Change("add", PREFILL), three)
        assert "from 2 to 2" in scale.apply(Change("remove", PREFILL), three)
        with pytest.raises(ActuationError, match="HTTP 404"):
            scale.apply(Change("add", DECODE), one)  # no such autoscaler here


@pytest.fixture(scope="module")
def planner_overlay(tmp_path_factory) -> list[dict]:
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBERNETES, tree, ignore=shutil.ignore_patterns("cluster-secret"))
    (tree / "base" / "cluster-secret").write_text("a-test-secret\n")
    objects = render(tree / "overlays" / "planner")
    kubectl = shutil.which("kubectl")
    if kubectl:
        import yaml

        printed = subprocess.run(
            [kubectl, "kustomize", str(tree / "overlays" / "planner")],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(objects, key=key) == sorted(yaml.safe_load_all(printed), key=key)
    return objects


def test_the_planner_overlay_is_valid_and_its_role_allows_what_the_actuator_calls(
    planner_overlay,
):
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in planner_overlay}
    for obj in planner_overlay:
        assert obj["metadata"]["namespace"] == "pdserve"
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, "1.37", strict=True)
    deployment = by_key[("Deployment", "pdserve-planner")]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["pdserve", "planner"]
    args = build_parser().parse_args(container["args"])
    assert args.actuator == "kubernetes" and args.max_workers >= 2
    # The router it reads is the router's Service, at its port.
    service = by_key[("Service", "pdserve-router")]
    port = service["spec"]["ports"][0]["port"]
    assert args.router == f"http://{service['metadata']['name']}:{port}"
    # It runs as the account the Role is bound to; the Role allows get and patch on exactly the
    # two autoscalers it names, which exist and scale the two pools.
    assert spec["serviceAccountName"] == "pdserve-planner"
    binding = by_key[("RoleBinding", "pdserve-planner")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "pdserve-planner",
    }
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    (rule,) = by_key[("Role", "pdserve-planner")]["rules"]
    assert rule["apiGroups"] == ["autoscaling"] and rule["verbs"] == ["get", "patch"]
    assert set(rule["resourceNames"]) == {args.prefill_autoscaler, args.decode_autoscaler}
    for role, name in ((PREFILL, args.prefill_autoscaler), (DECODE, args.decode_autoscaler)):
        hpa = by_key[("HorizontalPodAutoscaler", name)]
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"pdserve-{role}"
        assert args.max_workers >= hpa["spec"]["maxReplicas"]
    # The metrics port it serves is the one its probe reads.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == args.metrics_port
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
