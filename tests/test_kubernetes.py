"""deploy/kubernetes: both overlays render, every object is valid for a current Kubernetes
release and the Prometheus Operator's resources, and the pieces fit together: selectors find
the pods, ports are the ones the services listen on, every container's command line parses with
pdserve's own parsers, the drain fits in the grace period, the alert rules are deploy/alerts.yml's
and the autoscalers read metrics that the workers export and the adapter serves.

All offline: kubernetes-validate carries the Kubernetes schemas, the cloudcoil models the
Prometheus Operator's. Overlays render with tests/kustomize_subset.py, and where kubectl is
installed also with ``kubectl kustomize``, which must give the same objects.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as monitoring
from kustomize_subset import render
from prometheus_client import REGISTRY

from decode_worker.worker import build_parser as decode_parser
from pdserve import launcher
from prefill_worker.worker import build_parser as prefill_parser
from router.server import build_parser as router_parser

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# The newest release whose schemas kubernetes-validate carries, at most this one.
KUBERNETES_RELEASE = "1.37"
PARSERS = {"router": router_parser, "prefill": prefill_parser, "decode": decode_parser}
POOLS = ("prefill", "decode")
# A worker has left (the router holds nothing of it) within its drain timeout; its process ends
# after the interpreter's teardown too, a second or two (torch's alone is about one). A SIGKILL
# then would lose nothing, but the pod would end as killed: the grace period covers both.
TEARDOWN_S = 5.0

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[Obj]]:
    """Each overlay's objects. The manifests are copied out first, with a cluster secret made
    there, as a user makes one before applying them."""
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBERNETES, tree, ignore=shutil.ignore_patterns("cluster-secret"))
    (tree / "base" / "cluster-secret").write_text("a-test-secret\n")
    kubectl = shutil.which("kubectl")
    result = {}
    for overlay in OVERLAYS:
        objects = render(tree / "overlays" / overlay)
        if kubectl:
            printed = subprocess.run(
                [kubectl, "kustomize", str(tree / "overlays" / overlay)],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
            assert sorted(objects, key=_key) == sorted(yaml.safe_load_all(printed), key=_key)
        result[overlay] = objects
    return result


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if _key(o) == (kind, name)]
    assert len(found) == 1, (kind, name)
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def container(deployment: Obj) -> Obj:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def command_line(deployment: Obj) -> tuple[str, list[str]]:
    """The container's role (``pdserve ROLE``) and its arguments, with ``$(VAR)`` expanded as
    the kubelet expands it: only variables the container defines, here from the pod's fields."""
    spec = container(deployment)
    assert spec["command"][0] == "pdserve"
    env = {
        item["name"]: f"<{item['valueFrom']['fieldRef']['fieldPath']}>"
        for item in spec.get("env", [])
    }
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in spec["args"]]
    return spec["command"][1], [*spec["command"][2:], *args]


def parsed(deployment: Obj):
    role, argv = command_line(deployment)
    return PARSERS[role]().parse_args(argv)


def named_ports(deployment: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] in ("In", "NotIn")
        inside = labels.get(expression["key"]) in expression["values"]
        if inside != (expression["operator"] == "In"):
            return False
    return True


def pod_labels(deployment: Obj) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def deployments(objects: list[Obj]) -> dict[str, Obj]:
    """The pdserve Deployments by their command's role: router, prefill, decode."""
    result = {command_line(d)[0]: d for d in of_kind(objects, "Deployment")}
    assert sorted(result) == ["decode", "prefill", "router"]
    return result


# -- schemas ----------------------------------------------------------------------------------


def test_every_object_is_valid_for_kubernetes_and_the_prometheus_operator(rendered):
    for overlay, objects in rendered.items():
        assert {o["kind"] for o in objects} == {
            "Secret", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor", "PodMonitor", "PrometheusRule",
        }, overlay  # fmt: skip
        for obj in objects:
            assert obj["metadata"]["namespace"] == "pdserve"
            if obj["apiVersion"] == "monitoring.coreos.com/v1":
                check_monitoring_object(obj)
            else:
                # strict: a field the schema does not know (a misspelt key) is an error.
                kubernetes_validate.validate(obj, KUBERNETES_RELEASE, strict=True)


def check_monitoring_object(obj: Obj) -> None:
    """Validate against the Prometheus Operator's schema (its CRDs, as cloudcoil's models): the
    types by the model's validation, unknown fields by a round trip, which drops them."""
    model = getattr(monitoring, obj["kind"]).model_validate(obj)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj


def test_the_validators_refuse_what_they_should(rendered):
    """A misspelt field or a wrong type fails each check above: they are not vacuous."""
    deployment = one(rendered["cpu"], "Deployment", "pdserve-decode")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_RELEASE, strict=True)
    monitor = one(rendered["cpu"], "PodMonitor", "pdserve-workers")
    with pytest.raises(AssertionError):
        check_monitoring_object({**monitor, "spec": {**monitor["spec"], "podMetricEndpoints": []}})
    rule = one(rendered["cpu"], "PrometheusRule", "pdserve")
    bad = yaml.safe_load(yaml.safe_dump(rule))
    bad["spec"]["groups"][0]["rules"][0]["for"] = "a minute"
    with pytest.raises(ValueError):
        check_monitoring_object(bad)


# prometheus-adapter's rule format (its pkg/config: DiscoveryRule and the types it holds), as a
# JSON schema: the adapter has none of its own, and rejects unknown fields when it loads.
ADAPTER_RULE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["seriesQuery", "metricsQuery"],
    "properties": {
        "seriesQuery": {"type": "string"},
        "seriesFilters": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"is": {"type": "string"}, "isNot": {"type": "string"}},
            },
        },
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "template": {"type": "string"},
                "overrides": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "group": {"type": "string"},
                            "resource": {"type": "string"},
                        },
                    },
                },
                "namespaced": {"type": "boolean"},
            },
        },
        "name": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"matches": {"type": "string"}, "as": {"type": "string"}},
        },
        "metricsQuery": {"type": "string"},
    },
}
ADAPTER_VALUES_SCHEMA = {
    "type": "object",
    "required": ["rules"],
    "properties": {
        "rules": {
            "type": "object",
            "required": ["custom"],
            "properties": {
                "default": {"type": "boolean"},
                "custom": {"type": "array", "minItems": 1, "items": ADAPTER_RULE_SCHEMA},
            },
        }
    },
}
# What the adapter fills in a metrics query (Go templates with << >> delimiters).
ADAPTER_TEMPLATE_FIELDS = {".Series", ".LabelMatchers", ".GroupBy"}


def adapter_metrics() -> dict[str, str]:
    """The custom metrics the adapter serves: their name there -> the series it reads."""
    values = yaml.safe_load((KUBERNETES / "prometheus-adapter" / "values.yaml").read_text())
    jsonschema.validate(values, ADAPTER_VALUES_SCHEMA)
    served = {}
    for rule in values["rules"]["custom"]:
        series = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        assert set(re.findall(r"<<\s*([.\w]+)\s*>>", rule["metricsQuery"])) == (
            ADAPTER_TEMPLATE_FIELDS
        )
        # Per pod: the pods the PodMonitor scrapes carry namespace and pod labels.
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        go_replacement = rule["name"]["as"].replace("${1}", r"\1")
        name = re.sub(rule["name"]["matches"], go_replacement, series.group(1))
        served[name] = series.group(1)
    return served


# -- how the pieces fit -----------------------------------------------------------------------


def test_selectors_find_the_pods_they_mean(rendered):
    for objects in rendered.values():
        by_role = deployments(objects)
        for role, deployment in by_role.items():
            assert selects(deployment["spec"]["selector"], pod_labels(deployment)), role
            # No Deployment's selector takes another's pods.
            others = [pod_labels(d) for r, d in by_role.items() if r != role]
            assert not any(selects(deployment["spec"]["selector"], o) for o in others)

        def selected(selector: Obj, by_role: dict[str, Obj] = by_role) -> list[str]:
            return sorted(r for r, d in by_role.items() if selects(selector, pod_labels(d)))

        for service in of_kind(objects, "Service"):
            assert selected({"matchLabels": service["spec"]["selector"]}) == ["router"]
        for pool in POOLS:
            budget = one(objects, "PodDisruptionBudget", f"pdserve-{pool}")
            assert selected(budget["spec"]["selector"]) == [pool]
            target = one(objects, "HorizontalPodAutoscaler", f"pdserve-{pool}")["spec"]
            assert target["scaleTargetRef"]["name"] == by_role[pool]["metadata"]["name"]
        (router_monitor,) = of_kind(objects, "ServiceMonitor")
        monitored = router_monitor["spec"]["selector"]
        services = [s for s in of_kind(objects, "Service")
                    if selects(monitored, s["metadata"]["labels"])]  # fmt: skip
        assert [s["metadata"]["name"] for s in services] == ["pdserve-router"]
        (workers_monitor,) = of_kind(objects, "PodMonitor")
        assert selected(workers_monitor["spec"]["selector"]) == ["decode", "prefill"]


def test_ports_are_the_ones_the_services_listen_on(rendered):
    for objects in rendered.values():
        by_role = deployments(objects)
        router = by_role["router"]
        args, ports = parsed(router), named_ports(router)
        assert ports == {"http": args.port, "control": int(args.control.rsplit(":", 1)[1])}
        api = one(objects, "Service", "pdserve-router")
        control = one(objects, "Service", "pdserve-router-control")
        assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]
        assert [p["targetPort"] for p in control["spec"]["ports"]] == ["control"]
        # Workers register before the router is ready (it is ready once a decode worker has):
        # the control Service must list it before that.
        assert control["spec"]["publishNotReadyAddresses"] is True
        service_port = control["spec"]["ports"][0]["port"]
        for pool in POOLS:
            worker = by_role[pool]
            args = parsed(worker)
            assert args.router == f"tcp://pdserve-router-control:{service_port}"
            assert named_ports(worker) == {"metrics": args.metrics_port}
            # A worker advertises the address it binds: its pod's, which peers reach directly.
            assert args.host == "<status.podIP>"
            for probe in ("livenessProbe", "readinessProbe"):
                assert container(worker)[probe]["httpGet"]["port"] == "metrics"
            assert container(worker)["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert container(worker)["livenessProbe"]["httpGet"]["path"] == "/health"
        for probe in ("livenessProbe", "readinessProbe"):
            assert container(router)[probe]["httpGet"]["port"] in named_ports(router)
        assert container(router)["readinessProbe"]["httpGet"]["path"] == "/health"
        (router_monitor,) = of_kind(objects, "ServiceMonitor")
        assert [e["port"] for e in router_monitor["spec"]["endpoints"]] == ["http"]
        (workers_monitor,) = of_kind(objects, "PodMonitor")
        assert [e["port"] for e in workers_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_every_command_line_parses_and_holds_the_cluster_secret(rendered):
    for objects in rendered.values():
        (secret,) = of_kind(objects, "Secret")
        (key,) = secret["data"]
        for role, deployment in deployments(objects).items():
            args = parsed(deployment)  # argparse exits on anything it does not take
            assert args.model == "/models/models/SmolLM2-135M-Instruct", role
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            (mount,) = [m for m in container(deployment)["volumeMounts"]
                        if volumes[m["name"]].get("secret")]  # fmt: skip
            assert volumes[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
            assert args.cluster_secret_file == f"{mount['mountPath']}/{key}"


def test_a_worker_drains_within_its_pods_grace_period(rendered):
    for objects in rendered.values():
        for pool in POOLS:
            deployment = deployments(objects)[pool]
            grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert parsed(deployment).drain_timeout + TEARDOWN_S <= grace, pool
            # A rollout adds a worker before it drains one: what drains has somewhere to go.
            assert deployment["spec"]["strategy"]["rollingUpdate"] == {
                "maxSurge": 1,
                "maxUnavailable": 0,
            }


def test_monitors_and_rules_match_the_docker_compose_setup(rendered):
    alerts = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    for objects in rendered.values():
        (rule,) = of_kind(objects, "PrometheusRule")
        assert rule["spec"]["groups"] == alerts["groups"]
        # The alerts name jobs and a `role` label as deploy/prometheus.yml gives them: the
        # router's job is its Service's name, the workers' come from the PodMonitor.
        (workers_monitor,) = of_kind(objects, "PodMonitor")
        relabel = {r["targetLabel"]: r for r in
                   workers_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]}  # fmt: skip
        source = ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
        assert relabel["role"]["sourceLabels"] == relabel["job"]["sourceLabels"] == source
        components = [pod_labels(deployments(objects)[p])["app.kubernetes.io/component"]
                      for p in POOLS]  # fmt: skip
        assert components == list(POOLS)
        worker_jobs = {relabel["job"]["replacement"].replace("$1", c) for c in components}
        assert worker_jobs | {"pdserve-router"} == jobs


def test_autoscalers_read_metrics_the_workers_export_through_the_adapter(rendered):
    served = adapter_metrics()
    import common.metrics  # noqa: F401 - registers the workers' metrics

    exported = {family.name for family in REGISTRY.collect()}
    assert set(served.values()) <= exported
    for objects in rendered.values():
        read = {}
        for pool in POOLS:
            autoscaler = one(objects, "HorizontalPodAutoscaler", f"pdserve-{pool}")["spec"]
            assert all(m["type"] == "Pods" for m in autoscaler["metrics"])
            read[pool] = [m["pods"]["metric"]["name"] for m in autoscaler["metrics"]]
            assert set(read[pool]) <= set(served), pool
            assert autoscaler["minReplicas"] >= 1
        assert read == {
            "prefill": ["pdserve_num_prompt_tokens_queued"],
            "decode": ["pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"],
        }


def test_the_overlays_set_the_hardware_and_its_defaults(rendered):
    cpu, gpu = deployments(rendered["cpu"]), deployments(rendered["gpu"])
    for role in PARSERS:
        assert container(cpu[role])["image"] == "pdserve:cpu"
        assert container(gpu[role])["image"] == "pdserve:latest"
    # CPU: the defaults `pdserve up` gives a machine without a GPU, on whole dedicated cores.
    router = parsed(cpu["router"])
    assert router.remote_prefill_min_tokens == launcher.CPU_REMOTE_PREFILL_MIN_TOKENS
    assert router.local_prefill_overflow_tokens == launcher.CPU_LOCAL_PREFILL_OVERFLOW_TOKENS
    decode = parsed(cpu["decode"])
    assert decode.max_prefill_tokens_while_decoding == launcher.CPU_DECODE_WORKER_PREFILL_TOKENS
    for pool in POOLS:
        resources = container(cpu[pool])["resources"]
        assert resources["requests"] == resources["limits"]  # Guaranteed: pinned cores
        assert float(resources["limits"]["cpu"]).is_integer()
        assert (parsed(cpu[pool]).device, parsed(cpu[pool]).kv_transfer) == ("cpu", "zmq")
        # GPU: one GPU a worker (no tensor parallelism yet), pages over NIXL.
        assert container(gpu[pool])["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (parsed(gpu[pool]).device, parsed(gpu[pool]).kv_transfer) == ("cuda", "nixl")
        assert "nvidia.com/gpu" not in str(container(cpu[pool])["resources"])
