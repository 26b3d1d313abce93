"""KV pages between prefill and decode workers of different tensor-parallel sizes, through the
whole stack: router -> prefill -> decode, greedy tokens equal to the one-process engine at TP 1
with the same KV dtype (float32 exactly; FP8 / int8 pages quantise each head on its own, so a
rank's pages are the same bytes as the whole pool's heads), and pages really moved.

A cluster serves two pairs, to keep the suite short: `pdserve up` starts one prefill and one
decode worker, the test sends its prompts, then starts one more decode worker of another size
with a larger KV budget, which the router then prefers (it picks the decode worker with the most
free pages), and sends them again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cluster_harness import tiny_chat_cluster
from optional_backends import needs_nixl

from common import cluster_auth
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.args import engine_config_from_args
from common.engine.llm_engine import LLMEngine
from common.metrics import parse_exposition
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from decode_worker.worker import build_parser as decode_parser
from pdserve.launcher import build_parser as build_up_parser
from pdserve.launcher import role_flags
from prefill_worker.worker import build_parser as prefill_parser

# Longer than --remote-prefill-min-tokens, so they take the prefill worker; the second is more
# than one chunk of --max-num-batched-tokens, so its early pages move in parts. Each pair gets
# prompts of its own: a prompt the prefill worker has cached would be prefilled by the decode
# worker (the router sends a prefill worker only a long enough uncached suffix).
PROMPTS = [
    " ".join(f"item{i} is followed by item{i + 1}." for i in range(12)),
    " ".join(f"step {i}: add {i * 7 % 13} to the total;" for i in range(20)),
]
PAIR_PROMPTS = [PROMPTS, [f"Once more. {prompt}" for prompt in PROMPTS]]
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
RECEIVED = "pdserve_kv_pages_received_total"
FALLBACKS = "pdserve_kv_transfer_fallbacks_total"


def test_up_gives_each_role_its_tensor_parallel_size():
    args, _ = build_up_parser().parse_known_args(["--prefill-tp", "2", "--decode-tp", "4"])
    for role, parser, size in (("prefill", prefill_parser, 2), ("decode", decode_parser, 4)):
        flags = role_flags(args, role)
        assert flags[:2] == ["--tensor-parallel-size", str(size)]
        parsed = parser().parse_args(["--router", "tcp://127.0.0.1:1", "--model", "m", *flags])
        assert engine_config_from_args(parsed).tensor_parallel_size == size


def reference_tokens(folder: Path, kv_cache_dtype: str, prompts: list[str]) -> list[list[int]]:
    """The prompts' greedy tokens from the one-process engine at TP 1, same KV dtype."""
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", device="cpu",
                     cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
                     scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN))
    )  # fmt: skip
    tokenizer = Tokenizer(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [engine.generate([tokenizer.encode(p)], params)[0] for p in prompts]


def decode_metrics(base: str) -> dict[str, dict[str, float]]:
    """Every decode worker's metrics, by worker id."""
    with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
        workers = json.loads(response.read())["decode"]
    return {
        w["id"]: parse_exposition(
            urllib.request.urlopen(w["metrics_url"], timeout=10).read().decode()
        )
        for w in workers
    }


def wait_for_decode_workers(base: str, count: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while len(decode_metrics(base)) < count:
        assert process.poll() is None, "the extra decode worker exited"
        assert time.monotonic() < deadline, "the extra decode worker never registered"
        time.sleep(0.5)


def check_answers(client, folder: Path, prompts: list[str], expected: list[list[int]]) -> None:
    tokenizer = Tokenizer(folder)
    for prompt, tokens in zip(prompts, expected, strict=True):
        result = client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].text == tokenizer.decode(tokens)


def cluster_flags(backend: str, kv_dtype: str, prefill_tp: int, decode_tp: int) -> tuple:
    return ("--max-model-len", str(MAX_MODEL_LEN), "--remote-prefill-min-tokens", "32",
            "--kv-cache-memory", "16MiB", "--dtype", "float32", "--kv-transfer", backend,
            "--kv-cache-dtype", kv_dtype, "--max-num-batched-tokens", "96",
            "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
            "--kv-fetch-timeout", "20")  # fmt: skip


def start_decode_worker(base: str, folder: Path, backend: str, kv_dtype: str, tp: int):
    """One more decode worker, of tensor-parallel size ``tp``, with four times the KV budget of
    `pdserve up`'s: the router sends the next requests to it."""
    control = base.replace("http://", "tcp://").rsplit(":", 1)
    router = f"{control[0]}:{int(control[1]) + 1}"
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "decode", "--router", router,
         "--model", str(folder), "--worker-id", "extra-decode", "--log-level", "WARNING",
         "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB",
         "--dtype", "float32", "--kv-transfer", backend, "--kv-cache-dtype", kv_dtype,
         "--tensor-parallel-size", str(tp), "--kv-fetch-timeout", "20"]
    )  # fmt: skip


@pytest.mark.slow  # a cluster of up to nine processes, and a tenth
@pytest.mark.parametrize(
    ("backend", "kv_dtype", "prefill_tp", "decode_tps"),
    [
        ("zmq", "auto", 1, (2, 4)),
        pytest.param("nixl", "auto", 2, (1, 2), marks=needs_nixl),
        ("zmq", "int8", 2, (2, 1)),
        pytest.param("nixl", "fp8", 1, (2, 4), marks=needs_nixl),
    ],
)
def test_every_tp_pair_answers_as_one_process(
    tmp_path_factory, monkeypatch, backend, kv_dtype, prefill_tp, decode_tps
):
    """Pairs (prefill TP, decode TP) with decode TP ``decode_tps`` in turn: tokens equal, every
    prompt's pages fetched by the decode worker of that pair (none prefilled there)."""
    # One secret for `pdserve up` and the worker started beside it.
    monkeypatch.setenv(cluster_auth.SECRET_ENV, "tensor-parallel-cluster-test-secret")
    flags = cluster_flags(backend, kv_dtype, prefill_tp, decode_tps[0])
    with tiny_chat_cluster(tmp_path_factory, *flags) as (client, folder, base):
        expected = [reference_tokens(folder, kv_dtype, prompts) for prompts in PAIR_PROMPTS]
        check_answers(client, folder, PAIR_PROMPTS[0], expected[0])
        (first,) = decode_metrics(base).values()
        assert first.get(RECEIVED, 0) >= 2 and first.get(FALLBACKS, 0) == 0
        extra = start_decode_worker(base, folder, backend, kv_dtype, decode_tps[1])
        try:
            wait_for_decode_workers(base, 2, extra)
            check_answers(client, folder, PAIR_PROMPTS[1], expected[1])
            metrics = decode_metrics(base)["extra-decode"]
            assert metrics.get(RECEIVED, 0) >= 2 and metrics.get(FALLBACKS, 0) == 0
        finally:
            extra.send_signal(signal.SIGTERM)
            extra.wait(timeout=60)


def follower_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel ranks a worker spawned (multiprocessing's resource tracker aside)."""
    children = subprocess.run(
        ["pgrep", "-P", str(worker_pid)], capture_output=True, text=True
    ).stdout.split()
    ranks = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read()
        if b"multiprocessing" in argv and b"resource_tracker" not in argv:
            ranks.append(int(pid))
    return ranks


def busy_decode_worker_pid(base: str, launcher_pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
            workers = json.loads(response.read())["decode"]
        busy = next((w["id"] for w in workers if w["load"]["inflight"] >= 1), None)
        if busy is not None:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("no decode worker took the request")
    for pid in subprocess.run(
        ["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True
    ).stdout.split():
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1].decode() == busy:
            return int(pid)
    raise AssertionError(f"no process for {busy}")


@pytest.mark.slow  # `pdserve up` with two decode workers of two ranks each
def test_a_decode_rank_killed_mid_stream_loses_no_request(tmp_path_factory):
    """SIGKILL a decode worker's rank 1 while it streams: its rank 0 exits with it, the router
    migrates the request to the other decode worker, and the stream goes on, unchanged."""
    flags = ("--max-model-len", "1024", "--remote-prefill-min-tokens", "32",
             "--kv-cache-memory", "32MiB", "--dtype", "float32", "--decode", "2",
             "--decode-tp", "2")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as (client, folder, base):
        tokenizer = Tokenizer(folder)
        engine = LLMEngine(
            EngineConfig(model=str(folder), dtype="float32", device="cpu",
                         scheduler=SchedulerConfig(max_model_len=1024))
        )  # fmt: skip
        max_tokens = 160
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        expected = engine.generate([tokenizer.encode(PROMPTS[0])], params)[0]
        launcher = int(
            subprocess.run(["pgrep", "-f", f"pdserve.cli up --model {folder}"],
                           capture_output=True, text=True).stdout.split()[0]
        )  # fmt: skip
        stream = client.completions.create(
            model="tiny-chat", prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, killed = "", None
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if killed is None and len(text) > 20:
                (killed,) = follower_pids(busy_decode_worker_pid(base, launcher))
                os.kill(killed, signal.SIGKILL)
        assert killed is not None
        assert text == tokenizer.decode(expected)
