"""Fuzzing the router's published OpenAPI schema: no 5xx, and every error is OpenAI-shaped."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from router_fakes import router_server, start_fakes

from common.model.default_model import resolve_model_path

MODEL = resolve_model_path(None)
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def router():
    with router_server(MODEL, max_model_len=256) as r:
        start_fakes(r, {}, [("p0", "prefill"), ("d0", "decode")])
        r.wait_for_workers(1, 1)
        yield r


def fuzz_operation(op, base_url: str, failures: list, calls: list) -> None:
    @hypothesis.settings(
        max_examples=40,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=op.as_strategy())
    def run(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL.name  # reach past the model check most of the time
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 4)
        response = case.call(base_url=base_url, timeout=30)
        calls.append(response.status_code)
        bad = response.status_code >= 500
        if 400 <= response.status_code < 500:
            error = response.json().get("error")
            bad = not (isinstance(error, dict) and set(error) == ERROR_KEYS)
        if bad:
            failures.append((op.path, case.body, response.status_code, response.text[:200]))

    run()


@pytest.mark.slow
def test_fuzz_openapi_schema(router):
    schema = schemathesis.openapi.from_url(router.base_url + "/openapi.json")
    failures: list = []
    calls: list = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "POST":
            fuzz_operation(op, router.base_url, failures, calls)
    assert len(calls) >= 100
    assert not failures, failures[:3]
