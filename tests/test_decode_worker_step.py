"""A decode worker in-process, its step helper serving while the main loop is inside a step: a
handoff that comes during a long step has its pages fetched before the step ends, and joins
the batch at the first poll after it. Real sockets on loopback, a real KV sender; no router
(the worker is never registered) and no forward (the test stands in for the step)."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from tiny_models import build_tiny_model, random_prompts

from common.engine.kv_pool import KVPool
from common.messages import encode
from common.protocol import Handoff, TokenSample
from common.sampling_params import SamplingParams
from common.service.step_io import StepIO
from decode_worker.worker import DecodeWorker, build_parser
from kernels.sizes import ceil_div
from kvtransfer.registry import create_sender

# Generous: a loaded 2-core machine may take a while to schedule the helper thread.
DEADLINE_S = 30.0
PROMPT = random_prompts(1, seed=3, min_len=40, max_len=40)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("llama3-rope", tmp_path_factory.mktemp("model"))


@pytest.fixture
def worker(model):
    args = build_parser().parse_args(
        [
            "--router", "tcp://127.0.0.1:1", "--host", "127.0.0.1", "--model", str(model),
            "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--metrics-port", "0",
        ]
    )  # fmt: skip
    worker = DecodeWorker(args)
    worker.start_step_io()
    yield worker
    worker._step_io.close()
    worker.close()


@pytest.fixture
def sender(worker):
    """A prefill side in this process: its own pool of random pages, the worker's layout."""
    pool = KVPool(worker.engine.pool.layout, 16, "cpu")
    raw = pool.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(0),
                            dtype=torch.uint8))  # fmt: skip
    sender = create_sender("zmq", pool, engine_id="prefill-test")
    yield sender
    sender.close()


def handoff_of(sender, request_id: str) -> tuple[Handoff, list[int]]:
    """A handoff of PROMPT's pages from ``sender``'s pool, and which pages those are."""
    num_pages = ceil_div(len(PROMPT), sender.pool.layout.page_size)
    src = list(range(3, 3 + num_pages))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    transfer = sender.publish(request_id, src, lease_seconds=60)
    return Handoff(request_id, PROMPT, params, TokenSample(5), transfer), src


def pusher(worker) -> zmq.Socket:
    socket = worker.context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(worker.handoff_endpoint)
    return socket


def test_a_handoff_during_a_long_step_has_its_pages_by_the_steps_end(worker, sender):
    handoff, src = handoff_of(sender, "during")
    push = pusher(worker)
    assert isinstance(worker._step_io, StepIO)  # a CPU's forward holds the host: a helper
    worker.last_step_seconds = 0.5  # the step before was a CPU's
    with worker._step_io:  # the main loop is inside a step: it reads no socket until the end
        assert worker.handoff_socket in worker._sockets_during_step()
        push.send(encode(handoff))
        deadline = time.monotonic() + DEADLINE_S
        released: list[str] = []
        while not released:  # the sender hears the pages are in place
            assert time.monotonic() < deadline, "the pages did not arrive during the step"
            released = sender.poll()
            time.sleep(0.001)
        assert released == ["during"]
        # Fetched, not admitted: the batch is the main loop's to change, between steps.
        assert worker.handoffs.num_pending() == 1
        assert not worker.scheduler.holds("during")
    worker.poll_io()  # the first turn after the step
    assert worker.handoffs.num_pending() == 0
    [seq] = [s for s in worker.scheduler.waiting if s.request_id == "during"]
    assert seq.num_computed_tokens == len(PROMPT)
    assert seq.token_ids == [*PROMPT, 5]
    for s, d in zip(src, seq.page_ids, strict=True):
        assert torch.equal(worker.engine.pool.page_bytes(d), sender.pool.page_bytes(s))
    push.close()


def test_after_a_short_step_handoffs_wait_for_the_loop(worker, sender):
    """A GPU's millisecond steps do not wake the helper for handoffs; the loop reads them."""
    handoff, _ = handoff_of(sender, "after")
    push = pusher(worker)
    worker.last_step_seconds = 0.002
    assert worker._sockets_during_step() == []  # nothing in flight: the helper is not woken
    push.send(encode(handoff))
    with worker._step_io:
        pass
    deadline = time.monotonic() + DEADLINE_S
    while worker.handoffs.num_pending() == 0:  # the frame is read by the loop's own poll
        assert time.monotonic() < deadline, "the loop did not read the handoff"
        worker.poll_io()
        time.sleep(0.001)
    push.close()


def test_a_loop_that_sends_during_steps_leaves_handoffs_to_itself(worker):
    """Where the loop itself sends on the router link inside a step (a GPU's decode worker), the
    helper does not read handoffs even after a long step: refusing one would send on that link
    from a second thread."""
    worker._step_io.close()
    worker.start_step_io(pulse_inline=True)
    worker.last_step_seconds = 0.5
    assert not worker.reads_handoffs_during_step()
    assert worker.handoff_socket not in worker._sockets_during_step()
