"""Starts `pdserve up` for tests that drive the whole stack over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from tiny_models import build_tiny_chat_model

from benchmarks.harness import start_cluster
from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

STARTUP_TIMEOUT_S = 240


@contextmanager
def running_cluster(folder: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """`pdserve up --model folder *flags` until the block ends (then it must exit cleanly);
    yields the router's base URL."""
    cluster = start_cluster(folder, *flags, log=log_path)
    try:
        try:
            cluster.wait_until_up(STARTUP_TIMEOUT_S)
        except RuntimeError as exc:
            pytest.fail(f"pdserve up did not start: {exc}")
        yield cluster.base_url
    finally:
        code = cluster.stop()
    assert code == 0


@contextmanager
def tiny_chat_cluster(
    tmp_path_factory, *flags: str, family: str | None = None
) -> Iterator[tuple[openai.OpenAI, Path, str]]:
    """`pdserve up` over a tiny model (the tiny Llama, or of ``family``) with the default
    model's tokenizer, CPU-sized: yields an `openai` client, the model folder and the router's
    base URL. ``{model}`` in a flag is replaced by the model's folder."""
    folder = build_tiny_chat_model(
        tmp_path_factory.mktemp("chat-model") / "tiny-chat", family=family
    )
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


def worker_pids(launcher_pid: int, role: str) -> dict[str, int]:
    """The ``role`` workers `pdserve up` started, by worker id."""
    children = subprocess.run(
        ["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True
    ).stdout.split()
    found = {}
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"--worker-id" in argv:
            worker_id = argv[argv.index(b"--worker-id") + 1].decode()
            if worker_id.startswith(role):
                found[worker_id] = int(pid)
    return found


def kill_busy_decode_worker(base: str, launcher_pid: int) -> str:
    killed = kill_busy_worker(base, launcher_pid, "decode")
    assert killed is not None
    return killed


def kill_busy_worker(base: str, launcher_pid: int, role: str, at_least: int = 1) -> str | None:
    """SIGKILL the first ``role`` worker holding at least ``at_least`` requests (waiting up to
    30 s for one to); returns its id, or None if none got so busy."""
    deadline = time.monotonic() + 30
    busy = None
    while busy is None and time.monotonic() < deadline:
        workers = json.loads(urllib.request.urlopen(f"{base}/v1/workers", timeout=10).read())
        busy = next((w["id"] for w in workers[role] if w["load"]["inflight"] >= at_least), None)
        time.sleep(0.02)
    if busy is None:
        return None
    pid = worker_pids(launcher_pid, role).get(busy)
    assert pid is not None, f"no process for {busy}"
    os.kill(pid, signal.SIGKILL)
    return busy
