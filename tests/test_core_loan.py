"""Core loans between paired workers (common/service/core_loan.py): each side's flag, the
forward's threads layer by layer, and a forward whose results do not depend on them."""

from __future__ import annotations

import os
import time

import pytest
import torch
from engines import build_engine
from test_decode_worker_step import handoff_of, pusher
from tiny_models import build_tiny_model, random_prompts

from common.engine.kv_pool import KVPool
from common.messages import encode
from common.sampling_params import SamplingParams
from common.service.core_loan import (
    LAYERS_ON_LENT_CORES,
    LENT_CORES_IN_USE,
    CoreLoan,
    create_loan_file,
    omp_places,
)
from decode_worker.worker import DecodeWorker, build_parser
from kvtransfer.registry import create_sender


@pytest.fixture
def threads():
    """The process's thread count, put back after the test."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.fixture
def pair(tmp_path, threads):
    path = str(tmp_path / "loan")
    create_loan_file(path)
    sides = [CoreLoan(path, side, own_threads=threads, lent_threads=1) for side in (0, 1)]
    yield sides
    for side in sides:
        side.close()


def test_each_side_sees_only_the_others_flag(pair):
    first, second = pair
    # Both start busy: nobody lends before it says it waits.
    assert not first.partner_waiting() and not second.partner_waiting()
    second.mark_busy(False)
    assert first.partner_waiting() and not second.partner_waiting()
    first.mark_busy(False)
    second.mark_busy(True)
    assert not first.partner_waiting() and second.partner_waiting()


def test_a_layer_runs_on_the_lent_cores_only_while_the_partner_waits(pair, threads):
    first, second = pair
    first.before_layer()
    assert torch.get_num_threads() == threads and LENT_CORES_IN_USE._value.get() == 0
    layers = LAYERS_ON_LENT_CORES._value.get()
    second.mark_busy(False)
    first.before_layer()
    assert torch.get_num_threads() == threads + 1 and LENT_CORES_IN_USE._value.get() == 1
    assert LAYERS_ON_LENT_CORES._value.get() == layers + 1
    # The partner gets work mid-forward: the next layer gives its core back.
    second.mark_busy(True)
    first.before_layer()
    assert torch.get_num_threads() == threads and LENT_CORES_IN_USE._value.get() == 0
    second.mark_busy(False)
    first.before_layer()
    first.after_layers()  # the head and sampling: own threads, whatever the partner does
    assert torch.get_num_threads() == threads


def test_a_loan_needs_two_sides_with_cores(tmp_path):
    path = str(tmp_path / "loan")
    create_loan_file(path)
    with pytest.raises(ValueError, match="sides 0 and 1"):
        CoreLoan(path, 2, 1, 1)
    with pytest.raises(ValueError, match="at least one core"):
        CoreLoan(path, 0, 1, 0)


def test_places_put_a_workers_own_cores_first():
    assert omp_places({3, 2}, {0, 1}) == "{2},{3},{0},{1}"


class CountingThreads:
    def __init__(self) -> None:
        self.before = self.after = 0

    def before_layer(self) -> None:
        self.before += 1

    def after_layers(self) -> None:
        self.after += 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # GQA 3 and head_dim 32 in bf16: the C layers, and on AMX the tile prefill attention.
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("model"))


def test_the_forward_asks_before_every_layer_and_after_the_last(model):
    engine = build_engine(model, dtype="bfloat16")
    counting = engine.model.layer_threads = CountingThreads()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(random_prompts(1, seed=1, min_len=30, max_len=30)[0], params)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    # A prefill step (the torch layer modules) and decode steps (the fused C layers).
    layers = engine.model_config.num_layers
    assert steps == 3 and counting.before == steps * layers and counting.after == steps


def step_logits(engine, prompts) -> list[torch.Tensor]:
    """Every forward's logits while ``prompts`` are prefilled and decode four tokens greedily."""
    logits: list[torch.Tensor] = []
    forward = engine.model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    engine.model.forward = recording
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step()
    return logits


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lends a core: needs two")
@pytest.mark.parametrize(
    "dtype, deterministic",
    [("bfloat16", False), ("bfloat16", True), ("float32", True)],
    ids=["bf16", "bf16-deterministic", "fp32-deterministic"],
)
def test_logits_are_the_same_bits_on_lent_cores(model, tmp_path, threads, dtype, deterministic):
    """A prefill of rows long enough for every kernel to split its work, then decodes: one
    worker's forward on its own thread against the same forward on two (the partner waiting)."""
    prompts = random_prompts(3, seed=2, min_len=150, max_len=200)
    torch.set_num_threads(1)
    alone = step_logits(build_engine(model, dtype=dtype, deterministic=deterministic), prompts)
    path = str(tmp_path / "loan")
    create_loan_file(path)
    borrower, lender = CoreLoan(path, 0, 1, 1), CoreLoan(path, 1, 1, 1)
    lender.mark_busy(False)
    engine = build_engine(model, dtype=dtype, deterministic=deterministic)
    engine.model.layer_threads = borrower
    layers = LAYERS_ON_LENT_CORES._value.get()
    borrowed = step_logits(engine, prompts)
    assert LAYERS_ON_LENT_CORES._value.get() > layers
    assert len(alone) == len(borrowed)
    for one, two in zip(alone, borrowed, strict=True):
        assert torch.equal(one, two)
    borrower.close()
    lender.close()


def test_a_worker_lends_its_cores_while_it_waits_and_borrows_its_partners(tmp_path):
    """A decode worker in this process, paired through a flags file: busy while it loads and
    while it steps, waiting while it has nothing to run, gone once it closes; its forward asks
    the loan for each layer's threads."""
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    path = str(tmp_path / "loan")
    create_loan_file(path)
    partner = CoreLoan(path, 0, 1, 1)
    args = build_parser().parse_args(
        [
            "--router", "tcp://127.0.0.1:1", "--host", "127.0.0.1", "--model", str(folder),
            "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--metrics-port", "0", "--core-loan", path, "--core-loan-side", "1",
            "--lent-cores", "1",
        ]
    )  # fmt: skip
    worker = DecodeWorker(args)
    worker.start_step_io()
    pool = KVPool(worker.engine.pool.layout, 16, "cpu")
    sender = create_sender("zmq", pool, engine_id="prefill-test")
    push = pusher(worker)
    try:
        assert worker.engine.model.layer_threads is worker.core_loan
        assert not partner.partner_waiting()  # loaded, not yet in its loop
        worker.turn()
        assert partner.partner_waiting()
        busy_in_steps: list[bool] = []
        step = worker.step
        worker.step = lambda: (busy_in_steps.append(not partner.partner_waiting()), step())[1]
        handoff, _ = handoff_of(sender, "loan")
        push.send(encode(handoff))
        deadline = time.monotonic() + 30.0
        while not busy_in_steps or worker.scheduler.has_work:
            assert time.monotonic() < deadline, "the handed-off request did not finish"
            worker.turn()
            sender.poll()
        assert busy_in_steps and all(busy_in_steps)
        worker.turn()  # nothing left: waiting again
        assert partner.partner_waiting()
    finally:
        push.close()
        sender.close()
        worker._step_io.close()
        worker.close()
    assert partner.partner_waiting()  # a closed worker's cores are free
    partner.close()


@pytest.mark.parametrize(
    "case, error",
    [
        ("no lent cores", "needs --lent-cores"),
        ("no such file", "No such file"),
        ("a short file", "holds 1 bytes"),
    ],
)
def test_a_workers_loan_flags_are_checked(tmp_path, case, error):
    """A worker refuses loan flags it cannot use, with a ValueError (its start-up logs it)."""
    path = tmp_path / "loan"
    create_loan_file(str(path))
    lent = "0" if case == "no lent cores" else "1"
    if case == "no such file":
        path = tmp_path / "elsewhere"
    elif case == "a short file":
        path.write_bytes(b"\x01")
    args = build_parser().parse_args(
        ["--router", "tcp://127.0.0.1:1", "--model", "m", "--core-loan", str(path),
         "--lent-cores", lent]
    )  # fmt: skip
    with pytest.raises(ValueError, match=error):
        CoreLoan.from_args(args)
