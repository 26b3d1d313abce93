"""deploy/: every pdserve command in docker-compose parses with the real CLI, and Prometheus
scrapes the ports the services listen on. (The dashboard's and alert rules' metrics are checked
against a running cluster in test_metrics_documented.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from decode_worker.worker import build_parser as decode_parser
from prefill_worker.worker import build_parser as prefill_parser
from router.server import build_parser as router_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PARSERS = {"router": router_parser, "prefill": prefill_parser, "decode": decode_parser}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def commands() -> dict[str, list[str]]:
    """Each pdserve service's command, with ${VAR:-default} and ${VAR:+...} as if unset."""
    result = {}
    for name, service in compose()["services"].items():
        command = service.get("command")
        if not command or not command.strip().startswith("pdserve"):
            continue
        text = re.sub(r"\$\{\w+:\+[^}]*\}\}?", "", command)
        text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
        result[name] = shlex.split(text)
    return result


def without_tensor_parallelism(argv: list[str]) -> list[str]:
    if "--tensor-parallel-size" not in argv:
        return argv
    at = argv.index("--tensor-parallel-size")
    return argv[:at] + argv[at + 2 :]


def test_the_gpu_decode_pool_is_tensor_parallel_over_gpus_of_its_own():
    """The GPU profile shows pools sized apart: prefill on GPU 0, decode at TP 2 on 1 and 2."""
    services = compose()["services"]
    argv = commands()["decode-0"]
    size = int(argv[argv.index("--tensor-parallel-size") + 1])
    [devices] = services["decode-0"]["deploy"]["resources"]["reservations"]["devices"]
    [prefill_devices] = services["prefill-0"]["deploy"]["resources"]["reservations"]["devices"]
    assert size == len(devices["device_ids"]) == 2
    assert not set(devices["device_ids"]) & set(prefill_devices["device_ids"])


def test_every_service_command_parses():
    found = commands()
    assert {
        "router",
        "prefill-0",
        "decode-0",
        "router-cpu",
        "prefill-cpu-0",
        "decode-cpu-0",
    } <= set(found)
    for name, argv in found.items():
        assert argv[0] == "pdserve"
        args = PARSERS[argv[1]]().parse_args(argv[2:])
        # Every process holds the cluster secret, from a compose secret, never the environment.
        assert args.cluster_secret_file == "/run/secrets/cluster_secret"
        assert "cluster_secret" in compose()["services"][name]["secrets"]
        if argv[1] == "router":
            assert args.control == "tcp://172.28.0.10:8001"  # the cluster network only
        else:
            # A worker advertises the address it binds: it must be its fixed cluster address.
            address = compose()["services"][name]["networks"]["cluster"]["ipv4_address"]
            assert args.host == address
            assert args.router == "tcp://172.28.0.10:8001"


def test_prometheus_scrapes_every_service_port():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for s in job["static_configs"]
               for t in s["targets"]}  # fmt: skip
    services = compose()["services"]
    for name, argv in commands().items():
        address = services[name]["networks"]["cluster"]["ipv4_address"]
        port = argv[argv.index("--port") + 1] if "--port" in argv else None
        port = port or argv[argv.index("--metrics-port") + 1]
        assert f"{address}:{port}" in targets


def test_only_worker_targets_carry_a_role_label():
    # The router's pdserve_router_workers has its own `role` (the pool: alerts and dashboard group
    # by it); a `role` on the router's target would rename it to `exported_role`.
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    roles = {job["job_name"]: [s.get("labels", {}).get("role") for s in job["static_configs"]]
             for job in config["scrape_configs"]}  # fmt: skip
    assert roles == {
        "pdserve-router": [None],
        "pdserve-prefill": ["prefill"],
        "pdserve-decode": ["decode"],
    }


def test_profiles_split_gpu_and_cpu_services_and_prometheus_loads_the_alert_rules():
    services = compose()["services"]
    for name, argv in commands().items():
        profile = services[name]["profiles"]
        assert profile == (["cpu"] if "-cpu" in name else ["gpu"]), name
        # A CPU service is its GPU twin without the GPU: same command, same address (the GPU
        # decode worker alone is tensor-parallel, over two GPUs).
        if "-cpu" in name:
            twin = services[name.replace("-cpu", "")]
            assert argv == without_tensor_parallelism(commands()[name.replace("-cpu", "")])
            assert "deploy" not in services[name]
            assert "deploy" in twin or name == "router-cpu"
            assert services[name]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu}")
    assert "profiles" not in services["prometheus"]  # both profiles get it
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    mounts = services["prometheus"]["volumes"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
