"""Fuzzing the router's published OpenAPI schema: no 5xx, every error is OpenAI-shaped, and
well-formed requests are still served after every fuzzed one."""

from __future__ import annotations

import json

import httpx
import hypothesis
import pytest
import schemathesis
from router_fakes import DEADLINE_S, router_server, start_fakes, wait_until

from common.model.default_model import resolve_model_path

MODEL = resolve_model_path(None)
ERROR_KEYS = {"message", "type", "param", "code"}
MAX_TOKENS = 4
# What a client that plays by the rules sends: the router must keep answering these in full,
# whatever came before.
WELL_FORMED = [
    ("/v1/completions", {"model": MODEL.name, "prompt": "Say hello", "max_tokens": MAX_TOKENS}),
    (
        "/v1/chat/completions",
        {
            "model": MODEL.name,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": MAX_TOKENS,
        },
    ),
]


@pytest.fixture(scope="module")
def router():
    with router_server(MODEL, max_model_len=256) as r:
        start_fakes(r, {}, [("p0", "prefill"), ("d0", "decode")])
        r.wait_for_workers(1, 1)
        yield r


def answer(http: httpx.Client, path: str, body: dict) -> tuple[str, str | None]:
    """The text and finish reason of a well-formed request, streamed or not, checked to have
    come back whole: a 200, every token counted, a stream that ends with ``[DONE]``."""
    if not body.get("stream"):
        response = http.post(path, json=body)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
        reply = response.json()
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS, reply
        [choice] = reply["choices"]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"]
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, (path, response.status_code, response.read()[:300])
        lines = [line for line in response.iter_lines() if line]
    assert lines and lines[-1] == "data: [DONE]", (path, lines[-3:])
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    return text, choices[-1]["finish_reason"]


def assert_still_serving(http: httpx.Client, after: object) -> None:
    """Completions and chat, streamed and not, all answer with the fake workers' same few
    tokens, finished by length. ``after``: what was sent before, named if this fails."""
    answers = {
        (path, stream): answer(http, path, body | {"stream": stream})
        for path, body in WELL_FORMED
        for stream in (False, True)
    }
    texts = {text for text, _ in answers.values()}
    assert len(texts) == 1 and texts != {""}, (after, answers)
    assert {finish for _, finish in answers.values()} == {"length"}, (after, answers)


def fuzz_operation(op, http: httpx.Client, failures: list, calls: list) -> None:
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
        response = case.call(base_url=str(http.base_url), timeout=DEADLINE_S)
        calls.append(response.status_code)
        bad = response.status_code >= 500
        if 400 <= response.status_code < 500:
            error = response.json().get("error")
            bad = not (isinstance(error, dict) and set(error) == ERROR_KEYS)
        if bad:
            failures.append((op.path, case.body, response.status_code, response.text[:200]))
        assert_still_serving(http, (op.path, case.body, response.status_code))

    run()


@pytest.mark.slow
def test_fuzz_openapi_schema(router):
    schema = schemathesis.openapi.from_url(router.base_url + "/openapi.json")
    failures: list = []
    calls: list = []
    with router.client() as http:
        assert_still_serving(http, "nothing")
        for result in schema.get_all_operations():
            op = result.ok()
            if op.method.upper() == "POST":
                fuzz_operation(op, http, failures, calls)
        assert len(calls) >= 100
        assert not failures, failures[:3]
        # Every request, fuzzed or not, has left the router's books.
        wait_until(lambda: router.metric("pdserve_router_inflight_requests") == 0)
        assert_still_serving(http, "every fuzzed request")
