"""The decode worker's host loop alone: what a step costs when the model's forward costs nothing.

A real ``DecodeWorker`` (its sockets, scheduler, sampler, page tables, deltas to the router) runs
its own loop (``turn()``) against a router played here on loopback, with the model's forward
replaced by this benchmark's no-op: it returns rows of a preallocated random logits tensor of the
right shape. So every millisecond printed is host work a GPU would wait on between two steps:
scheduling, building the step's inputs, sampling, bookkeeping. (A step's token deltas are encoded
and sent while the next forward runs: with ``--forward-ms`` the no-op waits as long as a GPU's
step would, and what the host adds beyond that wait is what a GPU would idle for.)
One thing in it is not host work on a GPU: the sampler's pass over the logits (an argmax over
batch x vocabulary floats) runs on the device there. It is timed alone in the same run and
given beside the total, with the rest: the host's own share.

For each batch size, that many requests (random ``--prompt-len``-token prompts, greedy,
ignore_eos) are sent as ``DecodeRequest``s; once every one has its first token, ``--steps`` decode
steps are timed in five rounds, and the fastest round counts (this machine is shared). One line
per batch size::

    batch 64: 2.310 ms/step (1.950 of it the greedy argmax over 64 x 49152 logits, ...: host 0.360)

    python -m benchmarks.host_overhead [--batch-sizes 1,8,64] [--steps 300] [--vocab 49152]
                                       [--forward-ms 0]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq
from transformers import AutoModelForCausalLM, LlamaConfig

from common.messages import decode, encode
from common.protocol import (
    DecodeRequest,
    RegisterAck,
    RegisterWorker,
    TokenDelta,
    TokenDeltas,
)
from common.sampling_params import SamplingParams
from common.startup_objects import startup_objects_frozen
from decode_worker.worker import DecodeWorker, build_parser
from kernels.cpu_ops import argmax_rows


def build_model(folder: Path, vocab_size: int) -> Path:
    """A two-layer model with ``vocab_size`` tokens: only its vocabulary and config matter, the
    forward never runs."""
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


class NoOpForward:
    """Stands in for the model: one row of logits per position asked for, no work at all, or
    (``seconds``) a wait as long as a device's step, which, as a wait on a GPU does, leaves the
    CPU to whatever the worker does meanwhile."""

    def __init__(self, max_rows: int, vocab_size: int, seconds: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab_size, generator=generator)
        self.seconds = seconds

    def __call__(self, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return self.logits[: len(logits_indices)]


class LoopbackRouter:
    """The router's side of one worker's control socket, in a process of its own (as a router
    is, so it takes no time from the worker's): accepts the registration, sends the requests it
    is given, and says when each batch's requests have all had their first token."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve_router, args=(child,), daemon=True)
        self._process.start()
        self.address: str = self._pipe.recv()

    def start(self, requests: list[DecodeRequest]) -> None:
        self._pipe.send([encode(msg) for msg in requests])

    def all_started(self) -> bool:
        """Whether every request of the last ``start`` has had its first token."""
        return self._pipe.poll() and self._pipe.recv()

    def close(self) -> None:
        self._pipe.send(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


def _serve_router(pipe) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(f"tcp://127.0.0.1:{port}")
    worker: bytes | None = None
    waiting_for: set[str] = set()
    while True:
        if pipe.poll():
            frames = pipe.recv()
            if frames is None:
                break
            for frame in frames:
                waiting_for.add(decode(frame).request_id)
                socket.send_multipart([worker, frame])
        if not socket.poll(5):
            continue
        while True:
            try:
                sender, frame = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = decode(frame)
            if isinstance(msg, RegisterWorker):
                worker = sender
                socket.send_multipart([sender, encode(RegisterAck(accepted=True))])
            elif isinstance(msg, TokenDelta | TokenDeltas) and waiting_for:
                deltas = msg.all_deltas() if isinstance(msg, TokenDeltas) else [msg]
                waiting_for.difference_update(d.request_id for d in deltas)
                if not waiting_for:
                    pipe.send(True)
    socket.close(linger=0)
    context.term()


def start_worker(model: Path, router: LoopbackRouter, max_num_seqs: int) -> DecodeWorker:
    args = build_parser().parse_args(
        [
            "--router", router.address, "--host", "127.0.0.1", "--model", str(model),
            "--device", "cpu", "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", "4096",
            "--kv-cache-memory", "1GiB", "--metrics-port", "0",
        ]
    )  # fmt: skip
    worker = DecodeWorker(args)
    worker.start_step_io()
    worker.link.register(worker.registration(), timeout=30.0)
    return worker


def start_batch(
    worker: DecodeWorker, router: LoopbackRouter, batch: int, prompt_len: int
) -> list[str]:
    """Send ``batch`` requests and turn the worker's loop until each has its first token (their
    prompts prefilled by the no-op); their ids."""
    generator = torch.Generator().manual_seed(batch)
    vocab = worker.engine.model_config.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    router.start(
        [
            DecodeRequest(
                request_id,
                torch.randint(vocab, (prompt_len,), generator=generator).tolist(),
                params,
            )
            for request_id in ids
        ]
    )
    deadline = time.monotonic() + 600
    while not router.all_started():
        if time.monotonic() > deadline:
            raise RuntimeError("the worker did not start every request within 10 minutes")
        worker.turn()
    for _ in range(10):  # warm-up
        worker.turn()
    return ids


# Steps are timed in rounds, and the fastest round is kept: on a shared machine a round that
# another process interrupted says nothing about the loop.
ROUNDS = 5


def fastest_round_ms(run_once: Callable[[], object], steps: int) -> float:
    """Milliseconds per call of ``run_once`` in the fastest of ``ROUNDS`` rounds of ``steps``."""
    per_round = max(1, steps // ROUNDS)
    best = float("inf")
    for _ in range(ROUNDS):
        began = time.perf_counter()
        for _ in range(per_round):
            run_once()
        best = min(best, (time.perf_counter() - began) / per_round)
    return best * 1e3


def time_steps(worker: DecodeWorker, steps: int) -> float:
    """Milliseconds per pass of the worker's loop (each one decode step of the whole batch)."""
    return fastest_round_ms(worker.turn, steps)


def time_logits_read(logits: torch.Tensor, steps: int) -> float:
    """Milliseconds the sampler's one pass over a step's logits takes on this CPU: the part of
    a step here that a GPU does on the device."""
    return fastest_round_ms(lambda: argmax_rows(logits), steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="make the forward wait this long, as for a GPU's step: what the host does beside "
        "it (sending the previous step's tokens) then costs the step nothing",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(1)  # the host loop is one thread: measure it as one
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab)
        router = LoopbackRouter()
        worker = start_worker(model, router, max(batch_sizes))
        forward = NoOpForward(max(batch_sizes), args.vocab, args.forward_ms / 1e3)
        worker.engine.runner.model = forward
        try:
            # As in a worker process (run_worker): start-up's objects out of the collector's way.
            with startup_objects_frozen():
                for batch in batch_sizes:
                    ids = start_batch(worker, router, batch, args.prompt_len)
                    ms = time_steps(worker, args.steps)
                    reading = time_logits_read(forward.logits[:batch], args.steps)
                    host = ms - reading - args.forward_ms
                    wait = f", {args.forward_ms:g} the forward's wait" if args.forward_ms else ""
                    print(
                        f"batch {batch}: {ms:.3f} ms/step ({reading:.3f} of it the greedy argmax "
                        f"over {batch} x {args.vocab} logits, device work on a GPU{wait}: host "
                        f"{host:.3f})",
                        flush=True,
                    )
                    for request_id in ids:
                        worker.scheduler.abort(request_id)
        finally:
            worker.close()
            router.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
