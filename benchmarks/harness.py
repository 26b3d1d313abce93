"""Clusters, pinning, prompts and random-weight models: what every benchmark shares.

The benchmarks, and the tests that drive a whole cluster, take these from here, so that none
starts a cluster, pins a core or draws prompts in a way of its own:

- a `pdserve up` cluster: ``start_cluster`` (or ``pdserve_up`` around a block) starts it with any
  flags, ``Cluster.wait_until_up`` waits until it says every worker registered, and
  ``Cluster.stop`` stops it as Ctrl-C does, its whole process group killed if that takes too
  long; ``wait_for_server`` and ``stop_process`` do the same for any other server (vLLM's);
- pinning: ``pin_to_cores`` puts this process (with one torch thread per core) or a child on
  given cores, and ``memory_read_seconds`` times the read of a buffer, the floor of any step
  that streams weights or pages;
- prompts: ``random_prompts`` (random token ids, as vLLM's random dataset draws them) and
  ``chat_prompts`` (32 short chat requests through the model's chat template);
- models: ``random_model_like`` writes a folder with another model's config and tokenizer and
  random weights, ``save_random_model`` one of any config, and ``qwen2_with_key_outliers`` a
  Qwen2 shape whose keys carry outlier channels.

The GPU check (scripts/gpu_check.sh) serves SmolLM2-135M-Instruct with random weights: its config
and tokenizer are 3.5 MB, its weights 270 MB, more than a GPU run may carry. With ``ignore_eos``
(as the load client sends) the output lengths do not depend on what the weights say, so a
serving benchmark does the same work per token. From the command line::

    python -m benchmarks.harness random-model SOURCE DEST [--dtype bfloat16] [--seed 0]

prints DEST once it holds SOURCE's config.json and tokenizer files and random weights.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from common.tokenizer import Tokenizer

# -- a pdserve up cluster ----------------------------------------------------------------------

# What `pdserve up` prints once the router lists every worker it started.
UP_LINE = "pdserve is up"
# Long enough for `pdserve up` to drain its workers (25 s by default) and stop its router (15 s).
STOP_TIMEOUT_S = 90.0


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


@dataclass
class Cluster:
    """A `pdserve up` that ``start_cluster`` started: the launcher's process (the leader of a
    process group its services share), the router's base URL, and the file its output goes to
    (removed on ``stop`` where ``start_cluster`` made it up)."""

    process: subprocess.Popen
    base_url: str
    log_path: Path
    remove_log: bool = False
    exit_code: int | None = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_until_up(self, timeout: float = 600.0) -> float:
        """Until `pdserve up` says it is up; the seconds waited. Raises RuntimeError, with the
        end of its output, if it exits first or ``timeout`` passes."""
        began = time.monotonic()
        with open(self.log_path, errors="replace") as log:
            said = ""
            while UP_LINE not in said:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"pdserve up exited with {self.process.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() - began > timeout:
                    raise RuntimeError(
                        f"pdserve up was not up in {timeout:g} s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)
                # The line may arrive in two reads: keep the tail of the last one.
                said = said[-len(UP_LINE) :] + log.read()
        return time.monotonic() - began

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Stop the cluster as Ctrl-C does (the launcher drains its workers, then stops its
        router); past ``timeout``, kill its whole process group. Its exit code."""
        self.exit_code = stop_process(self.process, timeout)
        if self.remove_log:
            self.log_path.unlink(missing_ok=True)
        return self.exit_code


def start_cluster(
    model: str | Path | None,
    *flags: str,
    port: int | None = None,
    log: Path | None = None,
    log_level: str = "WARNING",
) -> Cluster:
    """`pdserve up --model MODEL --port PORT --log-level LOG_LEVEL *flags` (no ``--model``
    where ``model`` is None: `pdserve up`'s default, or one among ``flags``), its output into
    ``log`` (a file of its own when None). ``port`` None takes a free pair."""
    port = free_port_pair() if port is None else port
    remove_log = log is None
    if log is None:
        handle, name = tempfile.mkstemp(prefix="pdserve-up-", suffix=".log")
        os.close(handle)
        log = Path(name)
    command = [sys.executable, "-m", "pdserve.cli", "up"]
    command += ["--model", str(model)] if model is not None else []
    command += ["--port", str(port), "--log-level", log_level, *flags]
    with open(log, "w") as output:
        # A session of its own: its services join its process group, which stop() can kill.
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Cluster(process, f"http://127.0.0.1:{port}", log, remove_log)


@contextmanager
def pdserve_up(
    model: str | Path | None,
    *flags: str,
    port: int | None = None,
    log: Path | None = None,
    log_level: str = "WARNING",
    startup_timeout: float = 600.0,
) -> Iterator[Cluster]:
    """``start_cluster`` and ``wait_until_up`` before the block, ``stop`` after it."""
    cluster = start_cluster(model, *flags, port=port, log=log, log_level=log_level)
    try:
        cluster.wait_until_up(startup_timeout)
        yield cluster
    finally:
        cluster.stop()


def wait_for_server(
    base_url: str, process: subprocess.Popen, timeout: float, name: str = "the server"
) -> None:
    """Until ``base_url/health`` answers 200 (pdserve's router: once a decode worker has
    registered); raises RuntimeError if ``process`` (the server ``name``) exits first or the
    timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} did not become healthy in {timeout:g} s")


def stop_process(process: subprocess.Popen, timeout: float, whole_group: bool = False) -> int:
    """SIGTERM ``process`` (its whole process group with ``whole_group``), then, past
    ``timeout``, SIGKILL its process group: it must lead one (``start_new_session``). Its exit
    code."""
    if process.poll() is None:
        if whole_group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


# -- pinning -------------------------------------------------------------------------------------


def pin_to_cores(cores: Iterable[int], pid: int | None = None) -> None:
    """Run this process (``pid`` None) on ``cores`` with one torch thread per core, or run the
    process ``pid`` (a child just started: the threads it starts later inherit it) on them."""
    cores = set(cores)
    if pid is not None:
        os.sched_setaffinity(pid, cores)
        return
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def add_core_argument(parser: argparse.ArgumentParser) -> None:
    """``--core N``: the one core a single-core benchmark pins itself to."""
    parser.add_argument("--core", type=int, default=0, help="the one core to pin to")


# -- this machine's floors ---------------------------------------------------------------------


def memory_read_seconds(num_bytes: int, repeats: int) -> float:
    """Seconds to stream ``num_bytes`` from memory once (a sum over a buffer that size), the
    fastest of ``repeats``: what reading every weight byte, or a pool's pages, cannot beat."""
    import torch

    from kernels.timing import best_seconds

    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    return best_seconds(lambda: buffer.sum(), repeats)


# -- prompts -------------------------------------------------------------------------------------

# The low ids hold most vocabularies' control tokens; vLLM's random dataset skips them too.
FIRST_PLAIN_TOKEN = 100

TASKS = ["Explain", "Write a short poem about", "Give three facts about", "Describe"]
TOPICS = ["the moon", "photosynthesis", "the Roman empire", "volcanoes", "jazz music",
          "the water cycle", "honeybees", "the printing press"]  # fmt: skip


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly from the plain tokens of a
    vocabulary of ``vocab_size`` (a tokenizer's ``len``, or a model's ``vocab_size``); the same
    seed draws the same prompts, another seed others (no prefix-cache hit between them)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length)] for _ in range(count)
    ]


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """32 short chat requests ("Explain the moon.", ...) through the tokenizer's chat template."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"{task} {topic}."}])
        for task, topic in itertools.product(TASKS, TOPICS)
    ]


# -- models with random weights ------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_random_model(
    config: PretrainedConfig,
    dest: Path,
    dtype: torch.dtype,
    tokenizer_from: Path | None = None,
    seed: int = 0,
) -> Path:
    """Write ``dest``: a model of ``config`` whose weights are drawn as its own initialisation
    draws them, in ``dtype``, with the tokenizer files of ``tokenizer_from`` where given."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(dest)
    for name in TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest


def random_model_like(source: Path, dest: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write ``dest``: ``source``'s config and tokenizer, with random weights."""
    from transformers import AutoConfig

    return save_random_model(AutoConfig.from_pretrained(source), dest, dtype, source, seed)


def qwen2_with_key_outliers(folder: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A random Qwen2 of 2 KV heads of 128 whose key bias puts a few channels far above the rest
    (as a trained model's outlier channels are), with ``tokenizer_folder``'s tokenizer (so the
    same prompts apply). Random weights: its answers are not text, but they are as exact a
    function of the KV as any model's."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    head_dim = config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(config.num_key_value_heads, head_dim)
            bias.normal_(0.0, 0.1)
            # Two channels of each head, and their RoPE partners, ten times the rest.
            bias[:, [3, 17, 3 + head_dim // 2, 17 + head_dim // 2]] = 8.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.harness", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    random_model = commands.add_parser(
        "random-model", help="a folder with SOURCE's config and tokenizer and random weights"
    )
    random_model.add_argument("source", type=Path, help="folder with config.json and tokenizer")
    random_model.add_argument("dest", type=Path)
    random_model.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"]
    )
    random_model.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    print(random_model_like(args.source, args.dest, getattr(torch, args.dtype), args.seed))


if __name__ == "__main__":
    main()
