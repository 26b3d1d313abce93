"""The host's share of a step: what pdserve's own Python costs when the device's work costs
nothing, in two parts, each a subcommand.

``loop``: the decode worker's host loop alone. A real ``DecodeWorker`` (its sockets, scheduler,
sampler, page tables, deltas to the router) runs its own loop (``turn()``) against a router played
here on loopback, with the device's work replaced by this benchmark's no-ops: the model's forward
returns rows of a preallocated random logits tensor of the right shape, and the sampler's pass
over those logits (an argmax over batch x vocabulary floats, a kernel on a GPU) returns their
rows' argmax, known in advance. So every millisecond printed is host work a GPU would wait on
between two steps: scheduling, building the step's inputs, sampling's bookkeeping, the token
deltas. The loop runs as it does beside a GPU: a step's deltas are encoded and sent by the loop
itself once the next forward is launched (``StepIO``'s ``pulse_inline``), with no helper thread
woken for them. (With ``--forward-ms`` the no-op waits as long as a GPU's step would, without
the interpreter's lock, and the time printed leaves its waits out: what is left is what a GPU
would idle for. With no wait, the default, that sending is on the step's path too.)

Why the argmax is a no-op too: run on this CPU, its pass over 64 x 49152 floats (12.6 MB) evicts
the loop's objects and code from the core's caches, and the Python after it runs three times
slower than in a loop whose device work is elsewhere, as a GPU's is. ``--argmax-on-cpu`` runs it
anyway, times it alone in the same run and gives the total less that time as the host's share,
cold caches included.

For each batch size, that many requests (random ``--prompt-len``-token prompts, greedy,
ignore_eos) are sent as ``DecodeRequest``s; once every one has its first token, ``--steps``
decode steps are timed in five rounds, and the fastest round counts (this machine is shared).
One line per batch size::

    batch 64: 0.300 ms/step (the host alone; the argmax over 64 x 49152 logits it skips: 0.57 ms)

``--device-ms`` plays a GPU instead: each forward launched takes that long on a device
timeline of its own (from the later of its launch and the previous step's end), and the host
waits for a step's tokens only where a GPU's host would, when it reads them. The loop is timed
with decode steps taken one at a time and launched ahead (``--async-scheduling``, where the
next step is queued before this one's tokens are read), and what each leaves the device idle
per step is printed beside it::

    batch 64: one at a time 1.405 ms/step, launched ahead 0.997 ms/step, beside 1 ms device
    steps (the device idle 0.405 and 0.000 ms a step)

``forward``: what pdserve's own Python costs an eager forward on the Triton path. On a GPU an
eager forward (every prefill step, and a decode step without CUDA graphs) is paced by the host
issuing its launches, and for a small model that is most of its time: SmolLM2's shape took 23 ms
a decode step eager on an H100, 1.15 ms with graphs. Part of that is torch's and Triton's launch
machinery; part is pdserve's own Python around each launch (checks, block sizes, views, the
kernels' arguments). This part times the second on the CPU: the model runs as on CUDA for a
16-bit model (the Triton attention backend, the one-kernel norms, RoPE and SiLU-and-multiply),
with every Triton launch and every linear product (the head's too) made a no-op that returns (an
empty tensor of) the right shape. What is left is the forward's own host time, with torch's
cheapest calls (views, empty tensors) still in it. The model has SmolLM2-135M's layers (30, 9
query heads of 64, 3 KV heads, hidden 576, MLP 1536) with weights drawn in place and a
vocabulary of 1024. It times, best of ``--rounds``, a decode forward of ``--batch`` rows over 64
tokens of context each and a prefill forward of one ``--prompt``-token prompt, one line each
(``--profile`` adds the functions that take the most host time over 20 decode forwards)::

    decode 8 rows: 4.16 ms a forward, 139 us a layer

Triton's interpreter is what lets the kernels' Python run without a GPU, so ``forward`` runs
itself again with ``TRITON_INTERPRET=1`` where that is not set.

    python -m benchmarks.step.host_overhead loop [--batch-sizes 1,8,64] [--steps 300]
        [--vocab 49152] [--forward-ms 0 | --device-ms 0] [--argmax-on-cpu]
    python -m benchmarks.step.host_overhead forward [--batch 8] [--prompt 256] [--rounds 50]
        [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import multiprocessing
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq
from transformers import LlamaConfig

from benchmarks.harness import random_prompts, save_random_model
from common.engine import sampler as sampler_module
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
from kernels.argmax import argmax_rows

# -- the loop part ---------------------------------------------------------------------------------


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
    return save_random_model(config, folder, torch.float32)


class NoOpForward:
    """Stands in for the model: one row of logits per position asked for, no work at all, or
    (``seconds``) a wait as long as a device's step, which, as a wait on a GPU does, leaves the
    CPU (and the interpreter's lock) to whatever the worker does meanwhile. The time spent
    waiting is summed in ``waited``: it is the device's, not the host's."""

    def __init__(self, max_rows: int, vocab_size: int, seconds: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab_size, generator=generator)
        self.seconds = seconds
        self.waited = 0.0
        self.argmax = argmax_rows(self.logits)  # each row's token, for KnownArgmax
        self.device: SimulatedDevice | None = None  # set by attach_device: launch there

    def __call__(self, input_ids, positions, meta, logits_indices, lora=None) -> torch.Tensor:
        if self.device is not None:
            self.device.launch()
        elif self.seconds:
            began = time.perf_counter()
            time.sleep(self.seconds)
            self.waited += time.perf_counter() - began
        return self.logits[: len(logits_indices)]


class SimulatedDevice:
    """A GPU's timeline for ``--device-ms``: each step launched takes ``seconds`` of device
    time, starting once it is launched and the step before it has ended; ``wait_until`` waits,
    as a GPU's host does for a step's tokens, until that step has ended."""

    # The last stretch of a wait is spun: a sleep overshoots by tens of microseconds.
    SPIN_S = 2e-4

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last_end = 0.0  # when the step launched last ends

    def launch(self) -> None:
        self.last_end = max(time.perf_counter(), self.last_end) + self.seconds

    def wait_until(self, end: float) -> None:
        if end - time.perf_counter() > self.SPIN_S:
            time.sleep(end - time.perf_counter() - self.SPIN_S)
        while time.perf_counter() < end:
            pass


def attach_device(worker: DecodeWorker, forward: NoOpForward, device: SimulatedDevice) -> None:
    """Run ``worker``'s steps on ``device``: its forward launches a step there, and the host
    waits for a step's end where a GPU's host would wait for its tokens. A step taken alone is
    read by its argmax, right after its launch; a step launched ahead by its collection, after
    the next one is launched, so each launch's end is kept with it until then."""
    forward.device = device
    runner, sampler = worker.engine.runner, worker.engine.sampler
    argmax, launch_decodes, collect = sampler.argmax, runner.launch_decodes, runner.collect
    ends: dict[int, float] = {}

    def argmax_once_ended(logits: torch.Tensor):
        device.wait_until(device.last_end)
        return argmax(logits)

    def launch_and_note_end(batch, after=None):
        launched = launch_decodes(batch, after)
        ends[id(launched)] = device.last_end
        return launched

    def collect_once_ended(launched):
        device.wait_until(ends.pop(id(launched)))
        return collect(launched)

    sampler.argmax = argmax_once_ended
    runner.launch_decodes = launch_and_note_end
    runner.collect = collect_once_ended


class KnownArgmax:
    """Stands in for the sampler's argmax kernel while the forward is ``forward``'s no-op: the
    leading rows of its logits have their argmax computed once, so a step reads no logits (any
    other tensor still gets the real argmax)."""

    def __init__(self, forward: NoOpForward) -> None:
        self.forward = forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.forward.logits
        if (
            x.data_ptr() == logits.data_ptr()
            and x.stride() == logits.stride()
            and x.shape[1] == logits.shape[1]
        ):
            return self.forward.argmax[: x.shape[0]].clone()
        return argmax_rows(x)


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
    # As beside a GPU: the previous step's tokens go out from the loop itself once the forward
    # is launched, not from a helper thread (a CPU's way, where the forward runs on the host).
    worker.start_step_io(pulse_inline=True)
    worker.link.register(worker.registration(), timeout=30.0)
    return worker


def start_batch(
    worker: DecodeWorker, router: LoopbackRouter, batch: int, prompt_len: int
) -> list[str]:
    """Send ``batch`` requests and turn the worker's loop until each has its first token (their
    prompts prefilled by the no-op); their ids."""
    vocab = worker.engine.model_config.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
    router.start(
        [
            DecodeRequest(request_id, prompt, params)
            for request_id, prompt in zip(ids, prompts, strict=True)
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


def fastest_round_ms(
    run_once: Callable[[], object], steps: int, waited: Callable[[], float] = lambda: 0.0
) -> float:
    """Milliseconds per call of ``run_once`` in the fastest of ``ROUNDS`` rounds of ``steps``,
    less the seconds ``waited`` says were spent waiting on the device meanwhile."""
    per_round = max(1, steps // ROUNDS)
    best = float("inf")
    for _ in range(ROUNDS):
        waited_before = waited()
        began = time.perf_counter()
        for _ in range(per_round):
            run_once()
        elapsed = time.perf_counter() - began - (waited() - waited_before)
        best = min(best, elapsed / per_round)
    return best * 1e3


def time_steps(worker: DecodeWorker, forward: NoOpForward, steps: int) -> float:
    """Milliseconds per pass of the worker's loop (each one decode step of the whole batch), less
    the forward's waits."""
    return fastest_round_ms(worker.turn, steps, lambda: forward.waited)


def time_logits_read(logits: torch.Tensor, steps: int) -> float:
    """Milliseconds the sampler's one pass over a step's logits takes on this CPU: the part of
    a step here that a GPU does on the device."""
    return fastest_round_ms(lambda: argmax_rows(logits), steps)


def device_line(worker: DecodeWorker, batch: int, device_ms: float, steps: int) -> str:
    """The loop's wall time per step beside a simulated device, steps one at a time and then
    launched ahead, in one line."""
    engine = worker.engine
    figures = []
    for ahead in (False, True):
        engine.steps_ahead = ahead
        for _ in range(10):  # into the mode's steady state
            worker.turn()
        figures.append(fastest_round_ms(worker.turn, steps))
    alone, launched_ahead = figures
    return (
        f"batch {batch}: one at a time {alone:.3f} ms/step, launched ahead "
        f"{launched_ahead:.3f} ms/step, beside {device_ms:g} ms device steps (the device idle "
        f"{max(0.0, alone - device_ms):.3f} and {max(0.0, launched_ahead - device_ms):.3f} ms a "
        "step)"
    )


def abort_all(worker: DecodeWorker, request_ids: list[str]) -> None:
    for request_id in request_ids:
        worker.scheduler.abort(request_id)


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument(
        "--argmax-on-cpu",
        action="store_true",
        help="run the sampler's argmax over the logits here, and give the total less its time "
        "alone (its cold caches counted as the host's)",
    )
    device_time = parser.add_mutually_exclusive_group()
    device_time.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="play a GPU whose decode step takes this long, and time the loop with steps taken "
        "one at a time and launched ahead (--async-scheduling), wall time per step",
    )
    device_time.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="make the forward wait this long, as for a GPU's step, and count the time "
        "outside its waits: what the host does beside it (sending the previous step's tokens) "
        "then costs the step nothing",
    )


def run_loop(args: argparse.Namespace) -> None:
    """The ``loop`` part: one line per batch size."""
    logging.basicConfig(level=logging.WARNING)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(1)  # the host loop is one thread: measure it as one
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab)
        router = LoopbackRouter()
        worker = start_worker(model, router, max(batch_sizes))
        forward = NoOpForward(max(batch_sizes), args.vocab, args.forward_ms / 1e3)
        worker.engine.runner.model = forward
        if not args.argmax_on_cpu:
            sampler_module.argmax_rows = KnownArgmax(forward)
        if args.device_ms:
            attach_device(worker, forward, SimulatedDevice(args.device_ms / 1e3))
        try:
            # As in a worker process (run_worker): start-up's objects out of the collector's way.
            with startup_objects_frozen():
                for batch in batch_sizes:
                    ids = start_batch(worker, router, batch, args.prompt_len)
                    if args.device_ms:
                        print(device_line(worker, batch, args.device_ms, args.steps), flush=True)
                        abort_all(worker, ids)
                        continue
                    ms = time_steps(worker, forward, args.steps)
                    reading = time_logits_read(forward.logits[:batch], args.steps)
                    wait = (
                        f" beside {args.forward_ms:g} ms forwards (their waits not counted)"
                        if args.forward_ms
                        else ""
                    )
                    if args.argmax_on_cpu:
                        said = (
                            f"{reading:.3f} of it the greedy argmax over {batch} x {args.vocab} "
                            f"logits, device work on a GPU{wait}: host {ms - reading:.3f}"
                        )
                    else:
                        said = (
                            f"the host alone{wait}; the argmax over {batch} x {args.vocab} "
                            f"logits it skips: {reading:.3f} ms on this CPU"
                        )
                    print(f"batch {batch}: {ms:.3f} ms/step ({said})", flush=True)
                    abort_all(worker, ids)
        finally:
            worker.close()
            router.close()


# -- the forward part -----------------------------------------------------------------------------

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 30, 9, 3, 64, 576, 1536, 1024
CONTEXT = 64  # tokens of context each decode row attends over
PAGE_SIZE = 16


def run_forward(args: argparse.Namespace) -> None:
    """The ``forward`` part: a line for a decode forward and one for a prefill forward."""
    # Imported here: Triton reads TRITON_INTERPRET when a kernel is decorated.
    import torch
    from torch.nn import functional
    from transformers import LlamaConfig
    from triton.runtime.interpreter import InterpretedFunction

    from common.config import ModelConfig
    from common.engine.kv_pool import KVPool, kv_layout
    from common.model.loader import load_model
    from kernels.interface import AttentionMetadata
    from kernels.layer_kernels import CudaKernels
    from kernels.sizes import ceil_div
    from kernels.timing import best_seconds
    from kernels.triton.backend import TritonAttentionBackend

    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    # The few ops left that touch data (the embedding's rows, the head's) would otherwise start
    # parallel regions whose threads wait on a shared machine's other work: on a GPU they are
    # launches, not host threads.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            intermediate_size=MLP,
            num_hidden_layers=LAYERS,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(folder)
        config = ModelConfig.from_pretrained(folder)
    device, dtype = torch.device("cpu"), torch.float16
    model = load_model(config, dtype, device, load_format="dummy")
    model.use_kernels(CudaKernels())
    # Every linear layer and the head go through it.
    functional.linear = lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0])
    rows = max(args.batch * CONTEXT, args.prompt)
    num_pages = ceil_div(rows, PAGE_SIZE) + args.batch
    pool = KVPool(kv_layout(dtype, PAGE_SIZE, LAYERS, KV_HEADS, HEAD_DIM), num_pages, device)
    model.bind_kv(pool, TritonAttentionBackend())

    def decode_forward() -> None:
        batch, pages = args.batch, ceil_div(CONTEXT, PAGE_SIZE)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), CONTEXT, dtype=torch.int32),
            page_tables=torch.arange(batch * pages, dtype=torch.int32).view(batch, pages),
            slot_mapping=torch.arange(batch, dtype=torch.int64) * CONTEXT + CONTEXT - 1,
            max_query_len=1,
            max_seq_len=CONTEXT,
        )
        positions = torch.full((batch,), CONTEXT - 1)
        model(torch.ones(batch, dtype=torch.long), positions, meta, torch.arange(batch))

    def prefill_forward() -> None:
        tokens, pages = args.prompt, ceil_div(args.prompt, PAGE_SIZE)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([tokens], dtype=torch.int32),
            page_tables=torch.arange(pages, dtype=torch.int32)[None],
            slot_mapping=torch.arange(tokens, dtype=torch.int64),
            max_query_len=tokens,
            max_seq_len=tokens,
        )
        last = torch.tensor([tokens - 1])
        model(torch.ones(tokens, dtype=torch.long), torch.arange(tokens), meta, last)

    print(
        f"SmolLM2-135M's layers ({LAYERS}), float16, the Triton path's kernels made no-ops; "
        f"best of {args.rounds}"
    )
    with torch.inference_mode():
        for label, forward in (
            (f"decode {args.batch} rows", decode_forward),
            (f"prefill {args.prompt} tokens", prefill_forward),
        ):
            seconds = best_seconds(forward, args.rounds)  # this machine is shared
            per_layer = seconds / LAYERS * 1e6
            print(f"{label}: {seconds * 1e3:.2f} ms a forward, {per_layer:.0f} us a layer")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                decode_forward()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parts = parser.add_subparsers(dest="part", required=True)
    add_loop_arguments(
        parts.add_parser("loop", help="the decode worker's loop, device work no-ops")
    )
    forward = parts.add_parser(
        "forward", help="an eager forward on the Triton path, launches no-ops"
    )
    forward.add_argument("--batch", type=int, default=8, help="decode rows (default 8)")
    forward.add_argument("--prompt", type=int, default=256, help="prefill tokens (default 256)")
    forward.add_argument("--rounds", type=int, default=50)
    forward.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.part == "loop":
        run_loop(args)
        return 0
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        command = [sys.executable, "-m", "benchmarks.step.host_overhead", *sys.argv[1:]]
        os.execv(sys.executable, command)
    run_forward(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
