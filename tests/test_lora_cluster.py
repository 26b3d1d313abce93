"""LoRA adapters through the whole stack, as `pdserve up --enable-lora --lora-modules ...`
starts it: requests name an adapter as their model; greedy answers of two adapters and the base,
sent together, equal the one-process engine's (itself checked against PEFT in test_lora.py),
over the prefill worker's handoff and over a decode worker's own prefill alike."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_harness import running_cluster
from tiny_loras import save_tiny_lora
from tiny_models import build_tiny_chat_model

from common.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts `pdserve up`

# Longer than --remote-prefill-min-tokens: these prompts take the prefill worker.
LONG_PROMPT = " ".join(f"item{i} is followed by item{i + 1}." for i in range(12))
SHORT_PROMPT = "Hello there"
NEW_TOKENS = 12
API_KEY = "lora-admin-key"
STARTUP = ("sql", "chat")


def post(base: str, path: str, body: dict, key: str | None = API_KEY) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{base}{path}",
        json.dumps(body).encode(),
        {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def listed_workers(base: str) -> list[dict]:
    request = urllib.request.Request(
        f"{base}/v1/workers", headers={"authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        listing = json.loads(response.read())
    return listing["prefill"] + listing["decode"]


def wait_for(condition, deadline_s: float = 30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def one_process_engine(folder, adapters) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(num_pages=256),
            scheduler=SchedulerConfig(max_model_len=512),
            lora=LoraConfig(
                enable_lora=True,
                modules={name: str(path) for name, path in adapters.items()},
                max_loras=2,
            ),
        )
    )


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-cluster")
    folder = build_tiny_chat_model(root / "tiny-chat")
    adapters = {
        # Loaded at runtime by the tests: not among --lora-modules.
        "late": save_tiny_lora(
            folder, root / "late", seed=3, rank=16, targets=["o_proj", "up_proj"]
        ),
        "wide": save_tiny_lora(folder, root / "wide", seed=4, rank=32),
        "sql": save_tiny_lora(folder, root / "sql", seed=1, rank=8),
        "chat": save_tiny_lora(
            folder, root / "chat", seed=2, rank=4, use_rslora=True, targets=["q_proj", "v_proj"]
        ),
    }
    modules = [
        f"sql={adapters['sql']}",
        json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": "tiny"}),
    ]
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "32", "--kv-cache-memory",
             "64MiB", "--dtype", "float32", "--enable-lora", "--lora-modules", *modules,
             "--max-loras", "2", "--max-cpu-loras", "3", "--allow-runtime-lora-updating",
             "--api-key", API_KEY)  # fmt: skip
    with running_cluster(folder, root / "up.log", *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        yield client, folder, base, adapters


def test_models_lists_the_adapters_with_the_model_as_parent(lora_cluster):
    _, _, base, adapters = lora_cluster
    request = urllib.request.Request(
        f"{base}/v1/models", headers={"authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        listing = {entry["id"]: entry for entry in json.loads(response.read())["data"]}
    assert set(listing) == {"tiny-chat", "sql", "chat"}
    for name in STARTUP:
        path = adapters[name]
        assert listing[name]["parent"] == "tiny-chat"
        assert listing[name]["root"] == str(path)
    assert "parent" not in listing["tiny-chat"]
    # Every worker of both pools reports the adapters it serves (its heartbeats).
    assert wait_for(
        lambda: all(set(STARTUP) <= set(w["lora_adapters"]["served"]) for w in listed_workers(base))
    )


def test_an_unknown_adapter_is_vllms_404(lora_cluster):
    client = lora_cluster[0]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert "`nope` does not exist" in caught.value.body["message"]


def test_two_adapters_and_the_base_at_once_equal_the_one_process_engine(lora_cluster):
    client, folder, _, adapters = lora_cluster
    reference = one_process_engine(folder, {name: adapters[name] for name in STARTUP})
    tokenizer = Tokenizer(folder)
    cases = [
        (prompt, name) for prompt in (LONG_PROMPT, SHORT_PROMPT) for name in ("sql", "chat", None)
    ]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    expected = reference.generate(
        [tokenizer.encode(prompt) for prompt, _ in cases],
        greedy,
        lora_names=[name for _, name in cases],
    )

    def ask(case):
        prompt, name = case
        return client.completions.create(
            model=name or "tiny-chat", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
        )

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(ask, cases))
    for (prompt, name), result, tokens in zip(cases, results, expected, strict=True):
        assert result.model == (name or "tiny-chat")
        assert result.choices[0].text == tokenizer.decode(tokens), (prompt, name)
        assert result.usage.completion_tokens == NEW_TOKENS
    # Each adapter answers otherwise than the base.
    by_name = {
        name: tokens
        for (prompt, name), tokens in zip(cases, expected, strict=True)
        if prompt == LONG_PROMPT
    }
    assert by_name["sql"] != by_name[None] and by_name["chat"] != by_name[None]


def test_the_same_prompt_under_an_adapter_reuses_only_its_own_pages(lora_cluster):
    """The prefill worker's cache serves a prompt again under the same adapter, and never
    under another adapter or the base."""
    client = lora_cluster[0]
    prompt = " ".join(f"zebra{i} stands before zebra{i + 1}." for i in range(12))

    def cached(model):
        # More than one token: the handoff files the pages on the decode worker too, where the
        # router sends the prompt's short uncached rest the next time.
        result = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        details = result.usage.prompt_tokens_details
        return details.cached_tokens if details is not None else 0

    assert cached("sql") == 0
    assert cached("chat") == 0
    assert cached("tiny-chat") == 0
    assert cached("sql") > 0


def test_runtime_load_use_and_unload_under_load_lose_nothing(lora_cluster):
    """An adapter loaded while requests stream serves requests at once with the one-process
    engine's answers; unloading it while its requests are in flight waits for them, each
    finishing whole; then its name is unknown again. Bad loads are refused naming the problem."""
    client, folder, base, adapters = lora_cluster
    tokenizer = Tokenizer(folder)
    reference = one_process_engine(folder, {"late": adapters["late"]})
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    [expected] = reference.generate([tokenizer.encode(LONG_PROMPT)], greedy, lora_names=["late"])

    def ask(model, max_tokens=NEW_TOKENS):
        return client.completions.create(
            model=model, prompt=LONG_PROMPT, max_tokens=max_tokens, temperature=0
        )

    def stream_late(started: threading.Event) -> int:
        """The tokens a stream under "late" finished with (its closing usage: a chunk may carry
        several tokens, or none, of text when the box is busy)."""
        stream = client.completions.create(
            model="late",
            prompt=LONG_PROMPT,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        completion_tokens = 0
        for chunk in stream:
            started.set()
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        return completion_tokens

    with ThreadPoolExecutor(8) as pool:
        background = [pool.submit(ask, name, 24) for name in ("sql", "tiny-chat", "chat") * 2]
        status, text = post(
            base, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}
        )
        assert status == 200 and "added successfully" in text
        assert ask("late").choices[0].text == tokenizer.decode(expected)
        started = [threading.Event() for _ in range(3)]
        late = [pool.submit(stream_late, event) for event in started]
        assert all(event.wait(120) for event in started)
        # Unloading waits for the three streams under it, which all finish whole.
        status, text = post(base, "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert status == 200 and "removed successfully" in text
        assert [f.result() for f in late] == [48] * 3
        assert all(f.result().usage.completion_tokens == 24 for f in background)
    assert wait_for(
        lambda: not any("late" in w["lora_adapters"]["served"] for w in listed_workers(base))
    )
    with pytest.raises(openai.NotFoundError):
        ask("late")
    # Bad loads and unloads, each named.
    status, text = post(
        base, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(adapters["wide"])}
    )
    assert status == 400 and "rank 32 is above --max-lora-rank 16" in text
    status, text = post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert status == 400 and "adapter_config.json is not readable" in text
    status, text = post(
        base, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    )
    assert status == 400 and "already been loaded" in text
    status, text = post(base, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and "cannot be found" in text
    status, _ = post(
        base, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "/p"}, key=None
    )
    assert status == 401
    with pytest.raises(openai.NotFoundError):
        ask("wide")
