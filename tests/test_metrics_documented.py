"""docs/metrics.md's tables are the contract: every metric the code registers is listed there
once, a running cluster exports every metric listed, traffic moves every one not marked *on
faults* or *on a GPU*, and the Grafana dashboard and the alert rules name only listed metrics (so
none of their queries reads a series that does not exist)."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from cluster_harness import tiny_chat_cluster

pytestmark = pytest.mark.slow  # starts `pdserve up` and drives traffic

ROOT = Path(__file__).resolve().parent.parent
METRICS_DOC = ROOT / "docs/metrics.md"
DASHBOARD = ROOT / "deploy/grafana/dashboards/pdserve.json"
ALERTS = ROOT / "deploy/alerts.yml"
MODEL = "tiny-chat"
WORKER_TABLES = ("Workers", "KV transfer")
# The planner's metrics are its own process's (tests/test_planner_service.py scrapes them).
PLANNER_TABLE = "The planner"
# Every module that registers a metric. Those at module level register on import; the router
# makes its own per app (its SLO gauges only when an objective is set).
METRIC_MODULES = (
    "common/metrics.py",
    "common/service/core_loan.py",
    "kvtransfer/metrics.py",
    "planner/metrics.py",
    "router/metrics.py",
    "router/request_metrics.py",
)


def documented() -> dict[str, list[tuple[str, bool]]]:
    """docs/metrics.md's metric tables, by the heading each sits under: the (metric, whether this
    CPU cluster's traffic moves it) of every row."""
    tables: dict[str, list[tuple[str, bool]]] = {}
    heading = ""
    for line in METRICS_DOC.read_text().splitlines():
        row = re.match(r"\| `(pdserve_\w+)` \|", line)
        if row:
            # Rows marked *on faults* move on failures alone, *on a GPU* by default only there,
            # *with sliding windows* only for a model whose every layer has one, *on role
            # switches* only when a worker changes role, *with KV tiers* only in workers given a
            # tier below the pool, *with prefix fetches* only when a prompt prefilled on a decode
            # worker has leading pages a prefill worker holds.
            marks = (
                "*on faults*",
                "*on a GPU*",
                "*with sliding windows*",
                "*on role switches*",
                "*with KV tiers*",
                "*with prefix fetches*",
            )
            quiet_here = any(mark in line for mark in marks)
            tables.setdefault(heading, []).append((row.group(1), not quiet_here))
        elif line.startswith("## "):
            heading = line[3:]
    return tables


def registered() -> set[str]:
    """Every metric the code registers, as a scrape names it (a counter with ``_total``)."""
    from prometheus_client import REGISTRY

    from planner.metrics import PlannerMetrics
    from router.metrics import RouterMetrics
    from router.request_metrics import ServiceLevel

    for path in METRIC_MODULES:
        importlib.import_module(path.removesuffix(".py").replace("/", "."))
    router = RouterMetrics(ServiceLevel(ttft_s=1.0, tpot_s=1.0)).registry
    planner = PlannerMetrics().registry
    return {
        family.name + "_total" if family.type == "counter" else family.name
        for registry in (REGISTRY, router, planner)
        for family in registry.collect()
        if family.name.startswith("pdserve_")
    }


def families(exposition: str) -> dict[str, float | None]:
    """Each metric family of a /metrics page with the sum of its samples that count events (a
    counter's ``_total``, a histogram's ``_count``); None for a gauge, whose value may rest at
    zero however much traffic went by."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))
    sums: dict[str, float | None] = {}
    for family, kind in types.items():
        if family.endswith("_created"):
            continue  # when each series was created, not a metric
        if kind == "counter":
            family = family if family.endswith("_total") else family + "_total"
        name = family + "_count" if kind == "histogram" else family
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        values = [float(v) for v in re.findall(pattern, exposition, re.MULTILINE)]
        sums[family] = None if kind == "gauge" else sum(values)
    return sums


def base_name(series: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", series)


def rule_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], r["expr"]) for group in rules["groups"] for r in group["rules"]]


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_metrics_page_lists_each_metric_once():
    names = [name for rows in documented().values() for name, _ in rows]
    assert len(names) > 40
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_metric_the_code_registers_is_documented():
    listed = {name for rows in documented().values() for name, _ in rows}
    code = registered()
    assert not code - listed, f"registered but not in docs/metrics.md: {sorted(code - listed)}"
    assert not listed - code, f"in docs/metrics.md but never registered: {sorted(listed - code)}"


def test_the_metric_modules_are_every_module_that_registers_one():
    """A new module with metrics joins METRIC_MODULES, so the test above sees its metrics."""
    found = {
        str(path.relative_to(ROOT))
        for package in (
            "common",
            "kvtransfer",
            "router",
            "prefill_worker",
            "decode_worker",
            "planner",
        )
        for path in (ROOT / package).rglob("*.py")
        if re.search(r"\b(Counter|Gauge|Histogram|Summary)\(", path.read_text())
    }
    assert found == set(METRIC_MODULES)


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_dashboard_and_alerts_name_only_documented_metrics(source):
    listed = {name for rows in documented().values() for name, _ in rows}
    expressions = dashboard_expressions() if source == "dashboard" else rule_expressions()
    assert expressions
    for title, expr in expressions:
        used = re.findall(r"pdserve_\w+", expr)
        # Prometheus's own `up` is the one other series a rule may watch (a target is gone).
        assert used or re.match(r"up\{", expr), f"{title}: names no pdserve metric"
        for series in used:
            assert base_name(series) in listed, f"{title}: {series} is not a documented metric"


def test_alert_rules_are_complete():
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (`make tools` installs it)"
)
@pytest.mark.parametrize(
    "command", [["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]]
)
def test_promtool_accepts_the_alert_rules_and_their_unit_tests(command):
    """Syntax, then alerts_test.yml: the rules fire (and stay quiet) on synthetic series."""
    run = subprocess.run(
        ["promtool", *command], cwd=ALERTS.parent, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A cluster's /metrics pages (router, prefill worker, decode worker) after traffic."""
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "0",
             "--kv-cache-memory", "64MiB", "--dtype", "float32", "--slo-ttft-ms", "600000",
             "--slo-tpot-ms", "600000", "--speculative-method", "ngram",
             "--num-speculative-tokens", "2")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as (client, _, base):
        send_traffic(client, base)
        with httpx.Client(base_url=base, timeout=30) as http:
            pages = {"router": http.get("/metrics").text}
            workers = http.get("/v1/workers").json()
        for role in ("prefill", "decode"):
            url = workers[role][0]["metrics_url"]
            pages[role] = urllib.request.urlopen(url, timeout=30).read().decode()
    return {service: families(page) for service, page in pages.items()} | {"raw": pages}


def send_traffic(client, base: str) -> None:
    greedy = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    shared = "Tell me a story about a dragon who learned to cook. " * 4
    for _ in range(2):  # the second one hits the prefill worker's prefix cache
        client.completions.create(prompt=shared, max_tokens=6, **greedy)
    # Repeats the n-gram proposer can continue: speculation proposes.
    client.completions.create(prompt="one two three four " * 12, max_tokens=12, **greedy)
    chunks = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, stream=True, **greedy
    )
    assert sum(1 for _ in chunks) > 1
    # A structured output, twice: the second's grammar is compiled already.
    for _ in range(2):
        client.completions.create(
            prompt=shared, max_tokens=4, model=MODEL, temperature=0,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )  # fmt: skip
    # A client that leaves mid-stream: the router aborts the sequence on the workers.
    gone = client.completions.create(prompt=shared, max_tokens=300, stream=True, **greedy)
    next(iter(gone))
    gone.close()
    with httpx.Client(base_url=base, timeout=30) as http:
        deadline = time.monotonic() + 60
        while "pdserve_router_inflight_requests 0.0" not in http.get("/metrics").text:
            assert time.monotonic() < deadline, "sequences still in flight"
            time.sleep(0.2)


def test_every_documented_metric_is_exported_and_moves_under_traffic(scraped):
    for lead, rows in documented().items():
        if lead == PLANNER_TABLE:
            continue
        roles = ("prefill", "decode") if lead.startswith(WORKER_TABLES) else ("router",)
        for name, moves in rows:
            found = [scraped[role] for role in roles if name in scraped[role]]
            where = "/".join(roles)
            if lead.startswith("Workers"):  # both roles export these
                assert len(found) == len(roles), f"{name} missing on a worker ({where})"
            assert found, f"{name} missing on {where}"
            counts = [page[name] for page in found if page[name] is not None]
            if moves and counts:
                assert any(counts), f"{name} did not move on {where}"


def test_the_ttft_split_adds_up(scraped):
    """Router queue + prefill queue + prefill time + first-token hop is the time to first token,
    sequence by sequence, so their sums agree too."""
    router = scraped["raw"]["router"]

    def total(name: str) -> float:
        return float(re.search(rf"^{name}_sum (\S+)$", router, re.MULTILINE).group(1))

    stages = ("router_queue_time", "prefill_queue_time", "prefill_time", "first_token_hop")
    parts = [total(f"pdserve_request_{stage}_seconds") for stage in stages]
    assert all(part > 0 for part in parts), parts
    assert sum(parts) == pytest.approx(total("pdserve_time_to_first_token_seconds"), rel=1e-6)
