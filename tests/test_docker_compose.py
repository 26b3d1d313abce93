"""deploy/docker-compose.yml as docker-compose reads it, and its CPU profile started for real.

By default, wherever docker-compose is installed (no Docker engine needed): docker-compose accepts
the file under both profiles and resolves every pdserve service to the command, address, image
and build that tests/test_deploy.py checks in the YAML, and the Dockerfile copies every package
pyproject.toml ships.

Opt-in, ``PDSERVE_DOCKER_TESTS=1``, where a Docker engine answers: the images build, the router
and both workers come up and register, a greedy answer through them equals the one-process
engine's, and Prometheus scrapes every service, loads the alert rules and answers every dashboard
query. That takes about 6 minutes to build the images and 3 to run on a 2-core host, more than
the suite can spare, hence opt-in; it needs ports 8000 and 9090 free.
``PDSERVE_DOCKER_BUILD=local`` builds with deploy/build-local.sh (no registry: a Debian base
image and the host's wheels); otherwise ``docker-compose build`` with whatever BASE_IMAGE,
TORCH_INDEX_URL and WHEELS_URL say.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml
from test_deploy import commands

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ROUTER = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
MODEL = "SmolLM2-135M-Instruct"
OPT_IN = "PDSERVE_DOCKER_TESTS"
COMPOSE = ["docker-compose", "-f", str(DEPLOY / "docker-compose.yml")]
# The variables the file reads; unset, its defaults are what tests/test_deploy.py reads.
COMPOSE_VARIABLES = ("BASE_IMAGE", "TORCH_INDEX_URL", "WHEELS_URL", "KV_TRANSFER", "MODEL_DIR")

pytestmark = pytest.mark.timeout(3600)


def compose_missing() -> str | None:
    return None if shutil.which("docker-compose") else "docker-compose not installed"


@functools.cache
def engine_missing() -> str | None:
    """Why no Docker engine can be used here, or None where ``docker info`` answers."""
    if shutil.which("docker") is None:
        return "no Docker engine: the docker command is not installed"
    try:
        run = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker engine: `docker info` did not answer within 30 s"
    if run.returncode != 0:
        said = [line.strip() for line in (run.stderr or run.stdout).splitlines() if line.strip()]
        return f"no Docker engine: `docker info` failed: {said[-1] if said else run.returncode}"
    return None


def resolved(profile: str) -> dict:
    """The file as docker-compose resolves it for ``profile``, the build variables unset."""
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    run = subprocess.run([*COMPOSE, "--profile", profile, "config"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return yaml.safe_load(run.stdout)


@pytest.fixture(scope="module")
def docker_compose() -> None:
    if reason := compose_missing():
        pytest.skip(reason)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_resolves_every_service_as_the_yaml_says(docker_compose, profile):
    services = resolved(profile)["services"]
    for name, argv in commands().items():
        service = services[name]
        # Anchors merged, ${VAR:-default} filled in: what tests/test_deploy.py reads by hand.
        assert shlex.split(service["command"]) == argv, name
        assert service["build"]["context"] == str(ROOT)
        assert (ROOT / service["build"]["dockerfile"]) == DEPLOY / "Dockerfile"
        assert service["image"] == ("pdserve:cpu" if "-cpu" in name else "pdserve:latest"), name
        assert [s["source"] for s in service["secrets"]] == ["cluster_secret"]
    prometheus = services["prometheus"]
    assert (Path(prometheus["build"]["context"]) / prometheus["build"]["dockerfile"]).is_file()
    mounted = [volume.split(":")[0] for volume in prometheus["volumes"]]
    assert mounted and all(Path(source).is_file() for source in mounted), mounted


def test_the_image_copies_every_package_pyproject_ships():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    copies = re.findall(r"^COPY (\S+) (\S+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    copied = {source for source, _ in copies}
    assert shipped <= copied, shipped - copied
    assert all((ROOT / source).exists() for source in copied), copied


def compose(*args: str, timeout: float = 600) -> None:
    subprocess.run([*COMPOSE, "--profile", "cpu", *args], check=True, timeout=timeout)


def wait_for(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(2)


@pytest.fixture(scope="module")
def stack():
    reason = compose_missing() or engine_missing()
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(reason or f"building the images and running them takes about 9 minutes, more "
                    f"than the suite can spare: {OPT_IN}=1 runs it")  # fmt: skip
    if reason:
        pytest.fail(f"{OPT_IN}=1 but {reason}")
    secret = DEPLOY / "cluster-secret"
    if not secret.exists():
        secret.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    if os.environ.get("PDSERVE_DOCKER_BUILD") == "local":
        subprocess.run([str(DEPLOY / "build-local.sh")], check=True, timeout=3000)
        os.environ.setdefault("BASE_IMAGE", "pdserve-base:bookworm")
    else:
        compose("build", timeout=3000)
    try:
        compose("up", "-d")
        with httpx.Client(timeout=30) as http:
            wait_for(
                "both workers to register",
                lambda: all(
                    http.get(f"{ROUTER}/v1/workers").json()[r] for r in ("prefill", "decode")
                ),
                timeout=600,
            )
            yield http
    finally:
        compose("down", "--remove-orphans")


def test_greedy_answers_through_the_containers_equal_the_one_process_engine(stack):
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.sampling_params import SamplingParams

    models = stack.get(f"{ROUTER}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # Long enough to go through the prefill worker and the KV transfer.
    prompt = "Tell me about the history of Rome in great detail. " * 20
    answer = stack.post(
        f"{ROUTER}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True},
    ).json()  # fmt: skip
    choice = answer["choices"][0]
    engine = LLMEngine(EngineConfig(model=None))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert choice["token_ids"] == engine.generate([choice["prompt_token_ids"]], params)[0]
    chat = stack.post(
        f"{ROUTER}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
              "max_tokens": 16, "temperature": 0},
    ).json()  # fmt: skip
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip()
    assert chat["usage"]["completion_tokens"] > 0
    chunks = stack.post(
        f"{ROUTER}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
              "max_tokens": 8, "stream": True},
    ).text  # fmt: skip
    assert chunks.rstrip().endswith("data: [DONE]")
    assert chunks.count("chat.completion.chunk") >= 2


def test_prometheus_scrapes_every_service_and_answers_every_dashboard_query(stack):
    def targets():
        found = stack.get(f"{PROMETHEUS}/api/v1/targets").json()["data"]["activeTargets"]
        return {t["labels"]["job"]: t["health"] for t in found}

    def query(expr: str) -> dict:
        answer = stack.get(f"{PROMETHEUS}/api/v1/query", params={"query": expr}).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]

    jobs = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    wait_for("every target up", lambda: targets() == dict.fromkeys(jobs, "up"), timeout=120)

    def pools() -> dict[str, str]:
        found = query("sum by (role) (pdserve_router_workers)")["result"]
        return {r["metric"].get("role"): r["value"][1] for r in found}

    # The router's own `role` label (the pool), as the PdservePoolEmpty alert groups by it.
    wait_for("both pools in Prometheus", lambda: pools() == {"prefill": "1", "decode": "1"}, 60)

    stack.post(
        f"{ROUTER}/v1/completions",
        json={"model": MODEL, "prompt": "Hello " * 100, "max_tokens": 4},
    ).raise_for_status()
    wait_for(
        "the requests in Prometheus",
        lambda: query("sum(pdserve_request_success_total)")["result"],
        timeout=60,
    )
    moved = query("sum by (job) (pdserve_kv_transfer_bytes_total)")["result"]
    assert {r["metric"]["job"] for r in moved if float(r["value"][1]) > 0} == {
        "pdserve-prefill",
        "pdserve-decode",
    }
    rules = stack.get(f"{PROMETHEUS}/api/v1/rules").json()["data"]["groups"]
    healths = [rule["health"] for group in rules for rule in group["rules"]]
    assert healths and set(healths) == {"ok"}
    dashboard = json.loads((DEPLOY / "grafana/dashboards/pdserve.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            query(target["expr"].replace("$__rate_interval", "1m"))
