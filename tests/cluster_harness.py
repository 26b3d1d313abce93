"""Starts `pdserve up` for tests that drive the whole stack over HTTP."""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from tiny_models import build_tiny_chat_model

from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

STARTUP_TIMEOUT_S = 240


def free_port_pair() -> int:
    """A port P with P and P + 1 both free (the router's HTTP and control ports).

    Drawn below the kernel's ephemeral range: a port the kernel handed out would be free at
    the probe and could be taken by any outgoing connection (a worker's, a client's) before
    the router binds it."""
    low, _ = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - 1)
        try:
            for candidate in (port, port + 1):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


@contextmanager
def running_cluster(folder: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """`pdserve up --model folder *flags` until the block ends (then it must exit cleanly);
    yields the router's base URL."""
    port = free_port_pair()
    log = open(log_path, "w+")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(folder), "--port", str(port),
         "--log-level", "WARNING", *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            log.seek(0)
            if "pdserve is up" in log.read():
                break
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"pdserve up did not start:\n{log.read()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
        log.close()
    assert code == 0


@contextmanager
def tiny_chat_cluster(tmp_path_factory, *flags: str) -> Iterator[tuple[openai.OpenAI, Path, str]]:
    """`pdserve up` over a tiny model with the default model's tokenizer, CPU-sized: yields an
    `openai` client, the model folder and the router's base URL. ``{model}`` in a flag is
    replaced by the model's folder."""
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("chat-model") / "tiny-chat")
    log = tmp_path_factory.mktemp("logs") / "up.log"
    flags = tuple(flag.replace("{model}", str(folder)) for flag in flags)
    with running_cluster(folder, log, *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, folder, base


def reference_engine(folder: Path, max_model_len: int = 512) -> LLMEngine:
    """The same model in the one-process engine, fp32: what greedy output must equal."""
    return LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", device="cpu",
                     scheduler=SchedulerConfig(max_model_len=max_model_len))
    )  # fmt: skip


def greedy_reference(folder: Path):
    """(generate, tokenizer) for the same model in one process: ``generate(prompt_ids,
    max_tokens, **params)`` gives the greedy tokens the cluster's answer must equal."""
    engine = reference_engine(folder)

    def generate(prompt_ids: list[int], max_tokens: int, **params) -> list[int]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        return engine.generate([prompt_ids], sampling)[0]

    return generate, Tokenizer(folder)


def worker_metric(base: str, role: str, name: str) -> float:
    """One sample of the first ``role`` worker's /metrics page (0 if it is not there)."""
    with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
        url = json.loads(response.read())[role][0]["metrics_url"]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
