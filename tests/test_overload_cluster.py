"""Slow is not dead, through a real cluster: a prompt whose prefill outlasts the stall window
completes once; a worker stopped with SIGSTOP is still found out and its requests move; a flood
of junk frames on every socket evicts no worker and loses no request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import zmq
from cluster_harness import reference_engine, running_cluster
from tiny_models import build_tiny_chat_model

from common import cluster_auth
from common.cluster_auth import ClusterAuth
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts `pdserve up`

FLAGS = ("--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--dtype", "float32",
         "--remote-prefill-min-tokens", "8")  # fmt: skip


def metric(base: str, name: str, **labels: str) -> float:
    """A sample of the router's /metrics page (0 where it has none yet)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + wanted + '}') if wanted else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def workers(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())


def worker_metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + wanted + '}') if wanted else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def worker_pid(base: str, worker_id: str) -> int:
    """The process of worker ``worker_id`` of the cluster at ``base`` (its --router names the
    router's control port, its HTTP port plus one)."""
    control = f"tcp://127.0.0.1:{int(base.rsplit(':', 1)[1]) + 1}"
    found = subprocess.run(["pgrep", "-f", "--", control], capture_output=True, text=True)
    for pid in found.stdout.split():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1].decode() == worker_id:
            return int(pid)
    raise AssertionError(f"no process for {worker_id}")


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("overload") / "tiny-chat")


def test_prompts_whose_prefill_outlasts_the_stall_window_complete_once(model, tmp_path):
    """Six long prompts prefilled a token a step, one after another: the last waits, then
    prefills, for several stall windows without a token (heartbeats every half second). None is
    sent again, no prompt token is computed twice, and every answer is the one-process engine's."""
    window = 1.0
    flags = (*FLAGS, "--max-num-batched-tokens", "1", "--request-stall-timeout", str(window),
             "--heartbeat-timeout", "1.5")  # fmt: skip
    tokenizer = Tokenizer(model)
    prompts = [[100 + (i * 7919 + 31 * p) % 20000 for i in range(880)] for p in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = reference_engine(model, max_model_len=1024).generate(prompts, params)
    with running_cluster(model, tmp_path / "up.log", *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)

        def complete(prompt: list[int]):
            return client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        listed = workers(base)
        urls = [w["metrics_url"] for role in ("prefill", "decode") for w in listed[role]]

        def computed() -> float:
            # Both roles: a decode worker prefills what overflows a busy prefill worker.
            return sum(worker_metric(u, "pdserve_prompt_tokens_computed_total") for u in urls)

        computed_before = computed()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(complete, prompts))
        elapsed = time.monotonic() - started
        # The premise: the last prompt went several windows without a token.
        assert elapsed > 2 * window, f"the prefill took {elapsed:.1f} s: nothing to show"
        assert [r.choices[0].text for r in results] == [tokenizer.decode(t) for t in expected]
        assert metric(base, "pdserve_router_stalled_requests_total") == 0
        assert metric(base, "pdserve_router_redispatches_total", kind="prefill") == 0
        assert computed() - computed_before == sum(map(len, prompts))  # none computed twice


def test_a_decode_worker_stopped_with_sigstop_is_taken_out_and_its_stream_moves(model, tmp_path):
    """SIGSTOP freezes the whole process, its heartbeats too: after --heartbeat-timeout the
    router takes it out and migrates its stream, which goes on to the one-process engine's
    tokens."""
    flags = (*FLAGS, "--decode", "2", "--heartbeat-timeout", "2")
    tokenizer = Tokenizer(model)
    prompt = [100 + (i * 104729) % 20000 for i in range(200)]
    max_tokens = 300
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = reference_engine(model, max_model_len=1024).generate([prompt], params)[0]
    with running_cluster(model, tmp_path / "up.log", *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        stream = client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, stopped = "", None
        try:
            for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                if stopped is None and len(text) > 10:
                    [busy] = [w["id"] for w in workers(base)["decode"] if w["load"]["inflight"]]
                    stopped = worker_pid(base, busy)
                    os.kill(stopped, signal.SIGSTOP)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
        assert stopped is not None
        assert text == tokenizer.decode(expected)
        assert metric(base, "pdserve_router_workers_removed_total", cause="heartbeat_timeout") == 1
        assert metric(base, "pdserve_router_redispatches_total", kind="migrate") == 1


def flood(endpoint: str, frames: int, routed: bool, done: threading.Event) -> None:
    """Send ``frames`` frames of junk to ``endpoint``: through a DEALER to a ROUTER socket (the
    router's control socket, a KV side channel), else through a PUSH (a handoff socket). The
    sender proves the cluster secret: junk from a member gets past the handshake that keeps a
    stranger out, to the socket's reader."""
    auth = ClusterAuth(os.environ[cluster_auth.SECRET_ENV], lambda name: None)
    with zmq.Context() as context:
        socket = context.socket(zmq.DEALER if routed else zmq.PUSH)
        auth.client(socket)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)  # no limit: the sender never drops, the reader paces
        socket.connect(endpoint)
        junk = [os.urandom(8 + i % 64) for i in range(257)]
        for i in range(frames):
            socket.send(junk[i % len(junk)])
        # Every frame queued for the wire; the socket must stay open while it drains.
        while not done.wait(0.1):
            pass
        socket.close()


def test_a_flood_of_junk_on_every_socket_evicts_no_worker_and_loses_no_request(
    model, tmp_path, monkeypatch
):
    """100,000 junk frames each on the router's control socket, the decode worker's handoff
    socket and the prefill worker's KV side channel, while requests run: each socket's reader
    takes a bounded number a turn and logs a few lines, so every heartbeat still goes out,
    no worker is taken out, and every request is answered with the one-process engine's
    tokens."""
    frames = 100_000
    flags = (*FLAGS, "--heartbeat-timeout", "5")
    monkeypatch.setenv(cluster_auth.SECRET_ENV, "a secret the junk's sender knows too")
    tokenizer = Tokenizer(model)
    prompts = [[100 + (i * 7919 + 77 * p) % 20000 for i in range(120)] for p in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = reference_engine(model, max_model_len=1024).generate(prompts, params)
    with running_cluster(model, tmp_path / "up.log", *flags) as base:
        listed = workers(base)
        decode, prefill = listed["decode"][0], listed["prefill"][0]
        prefill_pid = worker_pid(base, prefill["id"])
        metrics_port = int(prefill["metrics_url"].rsplit(":", 1)[1].split("/")[0])
        [side_channel] = listening_ports(prefill_pid) - {metrics_port}
        control = f"tcp://127.0.0.1:{int(base.rsplit(':', 1)[1]) + 1}"
        targets = [
            (control, True),
            (decode["endpoint"], False),
            (f"tcp://127.0.0.1:{side_channel}", True),
        ]
        done = threading.Event()
        floods = [
            threading.Thread(target=flood, args=(endpoint, frames, routed, done), daemon=True)
            for endpoint, routed in targets
        ]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=180)

        def complete(prompt: list[int]):
            return client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        try:
            for thread in floods:
                thread.start()
            with ThreadPoolExecutor(max_workers=4) as pool:
                results = list(pool.map(complete, prompts))
            # Every junk frame was read and dropped, by each socket's reader.
            deadline = time.monotonic() + 120
            counts: tuple[float, ...] = ()
            while time.monotonic() < deadline:
                counts = (
                    metric(base, "pdserve_router_protocol_errors_total"),
                    worker_metric(decode["metrics_url"], "pdserve_bad_messages_total",
                                  socket="handoff"),
                    worker_metric(prefill["metrics_url"], "pdserve_kv_transfer_bad_messages_total",
                                  backend="zmq", side="sender"),
                )  # fmt: skip
                if min(counts) >= frames:
                    break
                time.sleep(0.5)
        finally:
            done.set()
        assert min(counts) >= frames, counts
        assert [r.choices[0].text for r in results] == [tokenizer.decode(t) for t in expected]
        assert metric(base, "pdserve_router_workers_removed_total", cause="heartbeat_timeout") == 0
        assert metric(base, "pdserve_router_stalled_requests_total") == 0
        # A handful of log lines per socket, not one per frame.
        log = (tmp_path / "up.log").read_text()
        assert log.count("dropped a frame") < 200, log.count("dropped a frame")


def test_an_abort_storm_leaves_every_other_stream_answered(model, tmp_path):
    """150 streams at once, every third one's client gone after its first chunk: each stream
    whose client stays gets all its tokens, and once the storm is over no worker holds anything
    and the router has nothing in flight."""
    flags = (*FLAGS, "--heartbeat-timeout", "5")
    prompts = [[100 + (i * 7919 + 13 * p) % 20000 for i in range(64)] for p in range(150)]
    with running_cluster(model, tmp_path / "up.log", *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=240)

        def stream(index: int) -> int | None:
            """The number of tokens streamed, or None where the client went away."""
            chunks = client.completions.create(
                model="tiny-chat", prompt=prompts[index], max_tokens=16, temperature=0,
                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            tokens = 0
            for chunk in chunks:
                if chunk.choices and getattr(chunk.choices[0], "token_ids", None):
                    tokens += len(chunk.choices[0].token_ids)
                if index % 3 == 0:
                    chunks.response.close()  # the client is gone
                    return None
            return tokens

        with ThreadPoolExecutor(max_workers=100) as pool:
            counts = list(pool.map(stream, range(len(prompts))))
        kept = [c for i, c in enumerate(counts) if i % 3]
        assert kept == [16] * len(kept)
        deadline = time.monotonic() + 60
        while True:
            held = [w["load"]["num_running"] + w["load"]["num_waiting"]
                    for role in ("prefill", "decode") for w in workers(base)[role]]  # fmt: skip
            if not any(held) and metric(base, "pdserve_router_inflight_requests") == 0:
                break
            assert time.monotonic() < deadline, f"still held after the storm: {held}"
            time.sleep(0.5)
        assert metric(base, "pdserve_router_aborts_total", cause="client_disconnected") >= 1
        assert metric(base, "pdserve_router_stalled_requests_total") == 0
