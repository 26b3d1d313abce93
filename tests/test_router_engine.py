"""The router in front of a real LLMEngine (the default model) playing a prefill/decode pair."""

from __future__ import annotations

import openai
import pytest
from router_fakes import EnginePair, model_text, router_server

from common.config import CacheConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams

MODEL = resolve_model_path(None)
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 6


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # float32: the served request reuses the reference's cached prefix, and in bf16 a prompt
    # computed over a cached prefix rounds differently from one computed whole.
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_pages=512)))


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    # Computed before the engine starts serving: the engine is not shared across threads.
    prompt = model_text(MODEL).encode(LONG)
    return engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]


@pytest.fixture(scope="module")
def served(engine, reference):
    with router_server(MODEL) as router:
        pair = EnginePair(router.control, engine, MODEL.name, "p0", "d0")
        pair.start()
        router.workers.append(pair)
        assert pair.ready.wait(30)
        router.wait_for_workers(1, 1)
        yield router, pair


def client(router) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.base_url + "/v1", api_key="none", max_retries=0, timeout=120
    )


def test_greedy_completion_equals_the_one_process_engine(served, reference):
    router, _ = served
    out = client(router).completions.create(
        model=MODEL.name, prompt=LONG, max_tokens=12, temperature=0, logprobs=1
    )
    assert out.usage.prompt_tokens >= 64  # the remote-prefill path
    assert out.choices[0].text == model_text(MODEL).decode(reference)
    assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens
    # The same prompt again: served from the prefix cache the engine reported.
    again = client(router).completions.create(
        model=MODEL.name, prompt=LONG, max_tokens=2, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_equals_non_stream_and_seed_reproduces(served):
    router, _ = served
    c = client(router)
    messages = [{"role": "user", "content": "Name three colours. 🎨"}]
    plain = c.chat.completions.create(
        model=MODEL.name, messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        c.chat.completions.create(
            model=MODEL.name, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == plain.choices[0].message.content
    seeded = [
        c.completions.create(
            model=MODEL.name, prompt="Once upon a time", max_tokens=8, seed=11, n=2
        )
        for _ in range(2)
    ]
    assert [ch.text for ch in seeded[0].choices] == [ch.text for ch in seeded[1].choices]
