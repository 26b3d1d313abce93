"""The whole stack as `pdserve up` starts it — router, prefill worker, decode worker, each its
own process — driven by the official `openai` client."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
import zmq
from cluster_harness import (
    greedy_reference,
    kill_busy_decode_worker,
    reference_engine,
    tiny_chat_cluster,
    worker_metric,
    worker_pids,
)
from tiny_models import build_tiny_chat_model
from zmq_strangers import send_unless_refused

from benchmarks.harness import free_port_pair, pdserve_up, start_cluster
from benchmarks.serving import load as serving
from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.kv_layout import KVLayout
from common.messages import PROTOCOL_VERSION, encode
from common.metrics import parse_exposition
from common.protocol import RegisterWorker
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # each test starts `pdserve up` or its processes

# Longer than --remote-prefill-min-tokens, so these prompts take the prefill worker.
LONG_PROMPT = " ".join(f"item{i} is followed by item{i + 1}." for i in range(20))
SHORT_PROMPT = "Hello there"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "32", "--kv-cache-memory",
             "64MiB", "--dtype", "float32")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def reference(cluster):
    """The same model in one process: what greedy output through the cluster must equal."""
    return greedy_reference(cluster[1])


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT])
def test_greedy_completion_equals_one_process_engine(cluster, reference, prompt):
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(prompt)
    expected = generate(prompt_ids, 16)
    result = client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=16, temperature=0, logprobs=1
    )
    choice = result.choices[0]
    assert choice.text == tokenizer.decode(expected)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(expected)
    assert choice.finish_reason in ("stop", "length")


def test_pdserve_up_starts_the_cluster_without_loading_torch(cluster):
    """The launcher asks whether there is a GPU before it starts anything; where torch's build
    has no GPU backend it answers from torch's version file, not by importing torch (seconds
    that every start waited on)."""
    _, _, base = cluster
    assert not torch_libraries(process_on_port("pdserve.cli up", base))


def test_the_router_serves_without_loading_torch(cluster):
    """The router runs no model: after it has served chat (the template) and completions, its
    process maps no torch library (transformers would load torch, for seconds of the router's
    start-up and hundreds of MiB of its memory, wherever it finds it installed)."""
    client, _, base = cluster
    messages = [{"role": "user", "content": "Hello"}]
    client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2)
    client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=2, logprobs=1)
    assert not torch_libraries(process_on_port("router", base))


def torch_libraries(pid: int) -> list[str]:
    """The torch libraries process ``pid`` maps (it must map some library: the check reads)."""
    with open(f"/proc/{pid}/maps") as maps:
        libraries = {line.split()[-1] for line in maps if line.rstrip().endswith(".so")}
    assert libraries
    return [path for path in libraries if "libtorch" in path]


def process_on_port(module: str, base: str) -> int:
    """The process `python -m MODULE ... --port PORT` of the cluster that serves ``base``."""
    port = base.rsplit(":", 1)[1]
    pattern = f"-m {module} .*--port {port}( |$)"
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
    assert len(found.stdout.split()) == 1, f"{pattern}: {found.stdout.split()}"
    return int(found.stdout.split()[0])


def test_long_prompts_are_prefilled_remotely_and_their_pages_shipped(cluster):
    client, _, base = cluster
    before = worker_metric(base, "decode", "pdserve_kv_pages_received_total")
    client.completions.create(model="tiny-chat", prompt="Again: " + LONG_PROMPT, max_tokens=4)
    assert worker_metric(base, "decode", "pdserve_kv_pages_received_total") > before


def test_streaming_equals_non_streaming_for_chat(cluster):
    client, _, _ = cluster
    messages = [{"role": "user", "content": "Say something about trains."}]
    whole = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=20, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_seed_reproducibility(cluster):
    client, _, _ = cluster

    def sample(seed: int):
        return client.completions.create(
            model="tiny-chat", prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, n=2,
            seed=seed,
        )  # fmt: skip

    first, again, other = sample(7), sample(7), sample(8)
    texts = [c.text for c in first.choices]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert [c.text for c in again.choices] == texts
    assert [c.text for c in other.choices] != texts


def test_logprobs_are_reported_per_token(cluster):
    client, _, _ = cluster
    result = client.completions.create(
        model="tiny-chat", prompt=LONG_PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_stop_string_cuts_the_text_and_is_not_emitted(cluster):
    client, _, _ = cluster
    free = client.completions.create(
        model="tiny-chat", prompt=LONG_PROMPT, max_tokens=24, temperature=0
    )
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    cut = client.completions.create(
        model="tiny-chat", prompt=LONG_PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_repeated_prompt_reports_cached_tokens(cluster):
    client, _, _ = cluster
    prompt = LONG_PROMPT + " Once more."
    client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_errors_are_openai_shaped(cluster):
    client, _, _ = cluster
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model="tiny-chat", prompt="word " * 600, max_tokens=2)


def test_strangers_cannot_register_or_hand_off(cluster):
    """`pdserve up` gives its processes a cluster secret: a process without it can neither
    register as a worker nor push a handoff; both are refused at the handshake and counted."""
    client, _, base = cluster
    port = int(base.rsplit(":", 1)[1])
    with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
        before = json.loads(response.read())
    context = zmq.Context()
    try:
        rogue = context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.IDENTITY, b"rogue-decode")
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(f"tcp://127.0.0.1:{port + 1}")
        send_unless_refused(rogue, encode(RegisterWorker(
            protocol_version=PROTOCOL_VERSION, worker_id="rogue-decode", incarnation="rogue",
            role="decode",
            model="tiny-chat", kv_layout=KVLayout("bfloat16", 16, 2, 2, 64),
            kv_transfer="zmq", num_pages=4096, max_model_len=512,
            metrics_url="http://127.0.0.1:1/metrics", handoff_endpoint="tcp://127.0.0.1:1",
        )))  # fmt: skip
        pusher = context.socket(zmq.PUSH)
        pusher.setsockopt(zmq.LINGER, 0)
        pusher.connect(before["decode"][0]["endpoint"])
        send_unless_refused(pusher, b"not a handoff")

        def refused(read_metric) -> float:
            """The count once it is at least 1, or at a generous deadline."""
            deadline = time.monotonic() + 30
            while True:
                value = read_metric()
                if value >= 1 or time.monotonic() > deadline:
                    return value
                time.sleep(0.1)

        router_refusals = refused(lambda: router_metric(base, "pdserve_auth_failures_total",
                                                        socket="control"))  # fmt: skip
        decode_refusals = refused(lambda: worker_metric(
            base, "decode", 'pdserve_auth_failures_total{socket="handoff"}'))  # fmt: skip
        assert router_refusals >= 1 and decode_refusals >= 1
        assert not rogue.poll(500)  # no RegisterAck for it
    finally:
        context.destroy(linger=0)
    with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
        after = json.loads(response.read())
    assert [w["id"] for w in after["decode"]] == [w["id"] for w in before["decode"]]
    result = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=4)
    assert result.usage.completion_tokens >= 1


def router_metric(base: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        samples = parse_exposition(response.read().decode())
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return samples.get(key, 0.0)


def test_the_startup_benchmark_times_a_cluster_up_and_its_first_answer(tmp_path):
    """benchmarks.startup.startup starts `pdserve up` (with the flags it does not know itself),
    waits for it to say it is up and for a first completion, and prints both times."""
    folder = build_tiny_chat_model(tmp_path / "m")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.startup.startup", "--model", str(folder),
         "--rounds", "1", "--port", str(free_port_pair()), "--max-model-len", "256",
         "--kv-cache-memory", "16MiB", "--dtype", "float32"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    summary = re.fullmatch(
        r"up: best ([\d.]+) s, median \1 s; first completion: best ([\d.]+) s, median \2 s",
        result.stdout.splitlines()[-1],
    )
    assert summary is not None, result.stdout
    up, first = float(summary[1]), float(summary[2])
    assert 0 < up <= first


def test_sigterm_stops_every_process(tmp_path):
    """`pdserve up` takes its children down with it."""
    folder = build_tiny_chat_model(tmp_path / "m")
    flags = ("--max-model-len", "256", "--kv-cache-memory", "16MiB")
    cluster = start_cluster(folder, *flags, log=tmp_path / "up.log")
    cluster.wait_until_up(240)
    process = cluster.process
    children = subprocess.run(
        ["pgrep", "-P", str(process.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) == 3
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    for child in children:
        with pytest.raises(ProcessLookupError):
            os.kill(int(child), 0)


@contextmanager
def launched(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pdserve up *flags` on a free port until the block ends; yields the launcher's process
    (its children are the services) and the router's base URL."""
    with pdserve_up(None, *flags) as cluster:
        yield cluster.process, cluster.base_url


def test_decode_worker_killed_mid_stream_migrates_and_the_stream_goes_on(tmp_path):
    folder = build_tiny_chat_model(tmp_path / "tiny-chat")
    flags = ("--model", str(folder), "--decode", "2", "--max-model-len", "1024",
             "--kv-cache-memory", "32MiB", "--dtype", "float32",
             "--remote-prefill-min-tokens", "8")  # fmt: skip
    with launched(*flags) as (process, base):
        tokenizer = Tokenizer(folder)
        engine = LLMEngine(
            EngineConfig(model=str(folder), dtype="float32", device="cpu",
                         scheduler=SchedulerConfig(max_model_len=1024))
        )  # fmt: skip
        max_tokens = 600
        expected = engine.generate(
            [tokenizer.encode(LONG_PROMPT)],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )[0]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        stream = client.completions.create(
            model="tiny-chat", prompt=LONG_PROMPT, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, killed = "", None
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if killed is None and len(text) > 20:
                killed = kill_busy_decode_worker(base, process.pid)
        assert killed is not None
        assert text == tokenizer.decode(expected)


def test_prefill_worker_killed_under_load_every_request_completes(tmp_path):
    """Kill -9 one of two prefill workers while both hold prompts: the router re-dispatches
    them through the other one, to the decode worker that was already expecting them (under a
    new id, so the abort of the first attempt cannot swallow the second), and every request
    completes with the tokens one process gives. Both prefill workers are paused (SIGSTOP)
    while the prompts are dispatched, so each surely holds several when one is killed: a toy
    model prefills a prompt in milliseconds, faster than anyone could watch for the moment."""
    folder = build_tiny_chat_model(tmp_path / "tiny-chat")
    flags = ("--model", str(folder), "--prefill", "2", "--max-model-len", "1024",
             "--kv-cache-memory", "64MiB", "--dtype", "float32",
             "--remote-prefill-min-tokens", "8", "--max-num-batched-tokens", "32",
             "--local-prefill-overflow-tokens", "1000000")  # fmt: skip
    with launched(*flags) as (process, base):
        tokenizer = Tokenizer(folder)
        prompts = [f"request {i}: " + LONG_PROMPT * 3 for i in range(24)]
        engine = reference_engine(folder, max_model_len=1024)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        expected = engine.generate([tokenizer.encode(p) for p in prompts], params)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt: str):
            return client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        paused = worker_pids(process.pid, "prefill")
        for pid in paused.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(max_workers=24) as pool:
                futures = [pool.submit(complete, p) for p in prompts]
                held = wait_for_inflight(base, "prefill", at_least=2)
                victim = max(held, key=held.__getitem__)
                os.kill(paused.pop(victim), signal.SIGKILL)
                for pid in paused.values():
                    os.kill(pid, signal.SIGCONT)
                paused = {}
                results = [f.result(timeout=180) for f in futures]
        finally:
            for pid in paused.values():
                os.kill(pid, signal.SIGCONT)
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 24
        assert [r.choices[0].text for r in results] == [tokenizer.decode(t) for t in expected]
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        redispatched = re.search(r'^pdserve_router_redispatches_total\{kind="prefill"\} (\S+)$',
                                 metrics, re.MULTILINE)  # fmt: skip
        assert redispatched and float(redispatched.group(1)) >= held[victim]


def wait_for_inflight(base: str, role: str, at_least: int) -> dict[str, int]:
    """Until every ``role`` worker has at least ``at_least`` requests in the router's books
    (generously: the workers are paused, nothing leaves them); each one's count."""
    import json

    deadline = time.monotonic() + 60
    while True:
        workers = json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())
        held = {w["id"]: w["load"]["inflight"] for w in workers[role]}
        if held and min(held.values()) >= at_least:
            return held
        assert time.monotonic() < deadline, f"the {role} workers held only {held}"
        time.sleep(0.05)


def test_a_step_longer_than_the_heartbeat_timeout_keeps_its_worker(tmp_path):
    """A worker's heartbeats go on while it computes a step, so a prefill step of 2,000 tokens
    (seconds on a CPU) under a 1-second heartbeat timeout takes no worker out, and short
    requests sent meanwhile all complete. The default model, for steps that are really long."""
    flags = ("--heartbeat-timeout", "1", "--max-num-batched-tokens", "2048",
             "--max-model-len", "2304", "--kv-cache-memory", "256MiB",
             "--remote-prefill-min-tokens", "64")  # fmt: skip
    with launched(*flags) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        long_prompt = [100 + (i * 7919) % 30000 for i in range(2000)]

        def complete(prompt, max_tokens):
            return client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        with ThreadPoolExecutor(max_workers=9) as pool:
            long_one = pool.submit(complete, long_prompt, 4)
            # The short requests go in while the long prompt's step runs: its worker's
            # heartbeats, sent during the step, count it running.
            deadline = time.monotonic() + 120
            while not (long_one.done() or prefill_running(base) >= 1):
                assert time.monotonic() < deadline, "the long prompt's step never started"
                time.sleep(0.05)
            short = [pool.submit(complete, f"Say {i}.", 8) for i in range(8)]
            results = [long_one.result(timeout=300)] + [f.result(timeout=300) for f in short]
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 9
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert "pdserve_router_workers_removed_total{" not in metrics


def prefill_running(base: str) -> int:
    """The sequences the prefill worker last reported running (in a heartbeat)."""
    with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
        workers = json.loads(response.read())["prefill"]
    return sum(w["load"]["num_running"] for w in workers)


def test_memory_levels_off_over_bursts_of_streams(tmp_path):
    """Four bursts of 500 concurrent streams: no service's idle resident memory after the last
    two exceeds its peak after the first two by more than 10%. Caches and arenas are warm after
    two bursts, and the allocator's heap swings by a few tens of MiB from one burst to the next
    (freed memory goes back to the system or not as fragmentation falls), so one level against
    one level would measure the swing; a leak raises every level after it, the lower of the last
    two included. Each worker keeps to its own core: with cores lent, a second thread's malloc
    arena holds whatever the layers it happened to run left there, a swing of its own (the
    decode worker's levels over eight bursts: 489-549 MiB, no trend; once 604 then 672 MiB)."""
    folder = build_tiny_chat_model(tmp_path / "tiny-chat")
    flags = ("--model", str(folder), "--max-model-len", "512", "--kv-cache-memory", "64MiB",
             "--dtype", "float32", "--remote-prefill-min-tokens", "16",
             "--no-lend-idle-cores")  # fmt: skip
    with launched(*flags) as (process, base):
        children = subprocess.run(
            ["pgrep", "-P", str(process.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 3
        after = []
        for _ in range(4):
            asyncio.run(stream_burst(base, "tiny-chat", count=500))
            after.append([resident_mib(pid) for pid in children])
        for service, levels in enumerate(zip(*after, strict=True)):
            warm_peak, late_floor = max(levels[:2]), min(levels[2:])
            assert late_floor <= warm_peak * 1.1, (service, after)


async def stream_burst(base: str, model: str, count: int) -> None:
    """``count`` streams at once, each read to its end (and checked to have finished)."""
    import httpx

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=count)) as c:

        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"item {i} " * (5 + i % 40), "max_tokens": 24,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with c.stream("POST", f"{base}/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"

        await asyncio.gather(*(one(i) for i in range(count)))


def resident_mib(pid: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_the_serving_benchmark_reads_the_decode_workers_steps_over_its_run(cluster):
    """benchmarks.serving.load puts TPOT beside the decode workers' own step time over the run:
    their step histograms, read through the metrics pages the router lists, grow by the steps of the
    requests between two readings."""
    client, _, base = cluster
    before = serving.decode_steps(base)
    assert before is not None
    result = client.completions.create(
        model="tiny-chat", prompt=SHORT_PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert result.usage.completion_tokens == 8
    during = serving.decode_steps(base) - before
    assert during.count >= 7 and during.seconds > 0  # every token after the first is a step
    figures = serving.report(
        [serving.Result(ttft=0.1, token_times=[0.02] * 7, output_tokens=8)],
        1.0,
        argparse.Namespace(isl=4, osl=8, num_prompts=1, concurrency=1),
        serving.DecodeSteps(0.1, 10),
    )
    assert figures["decode_step_ms"] == pytest.approx(10.0)
    assert figures["tpot_over_step"] == pytest.approx(2.0)
    assert serving.decode_steps("http://127.0.0.1:9") is None  # nothing there: no figure
