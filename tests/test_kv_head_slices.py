"""KV heads between pools that hold different runs of them (tensor-parallel ranks): which prefill
rank serves which decode heads, the layouts that are refused, and the bytes a read of a head
slice leaves in the receiving pool, over both backends, without a cluster (a sender and a
receiver in this process, polled in turn)."""

from __future__ import annotations

import time

import pytest
import torch
from kv_sender_process import fill_pool
from optional_backends import backend_params

from common.engine.kv_pool import KVPool
from common.kv_layout import KVLayout
from common.model.parallel import TensorParallel
from common.protocol import RankSender
from kvtransfer import TransferError, TransferParams, create_receiver, create_sender
from kvtransfer.head_map import HeadSource, plan_heads
from kvtransfer.tp_group import group_receiver

DTYPES = {"f32": "float32", "fp8": "float8_e4m3fn", "int8": "int8_hadamard"}
MODEL_KV_HEADS = 4
CUDA = torch.cuda.is_available()
NUM_PAGES = 12


def rank_heads(size: int, model_kv_heads: int = 2) -> list[range]:
    return [TensorParallel(rank, size).kv_heads(model_kv_heads) for rank in range(size)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "expected"),
    [
        (1, 1, [[HeadSource(0, range(0, 2))]]),
        (1, 2, [[HeadSource(0, range(0, 1))], [HeadSource(0, range(1, 2))]]),
        (2, 1, [[HeadSource(0, range(0, 1)), HeadSource(1, range(1, 2))]]),
        (2, 2, [[HeadSource(0, range(0, 1))], [HeadSource(1, range(1, 2))]]),
        (1, 4, [[HeadSource(0, range(0, 1))]] * 2 + [[HeadSource(0, range(1, 2))]] * 2),
        # Four prefill ranks over two heads: each head from the first rank that holds it.
        (4, 1, [[HeadSource(0, range(0, 1)), HeadSource(2, range(1, 2))]]),
        (4, 2, [[HeadSource(0, range(0, 1))], [HeadSource(2, range(1, 2))]]),
    ],
)
def test_each_decode_rank_takes_its_heads_from_the_ranks_that_hold_them(
    prefill_tp, decode_tp, expected
):
    holders = rank_heads(prefill_tp)
    plans = [plan_heads(wanted, holders) for wanted in rank_heads(decode_tp)]
    assert plans == expected
    # Decode rank 0's first head always comes from prefill rank 0 (the lease holder).
    assert plans[0][0].source == 0


def test_heads_no_prefill_rank_holds_are_refused():
    with pytest.raises(ValueError, match=r"KV heads \[2, 3\] are held by no prefill rank"):
        plan_heads(range(0, 4), [range(0, 1), range(1, 2)])
    with pytest.raises(ValueError, match="run of KV heads"):
        plan_heads(range(0), [range(0, 2)])


def test_layouts_compare_format_and_model_heads_not_which_heads():
    whole = KVLayout("bfloat16", 16, 2, 2, 64)
    rank1 = KVLayout("bfloat16", 16, 2, 1, 64, first_kv_head=1, model_kv_heads=2)
    assert whole.mismatch(rank1) is None and rank1.mismatch(whole) is None
    other_model = KVLayout("bfloat16", 16, 2, 1, 64, first_kv_head=1, model_kv_heads=4)
    assert "total_kv_heads: 2 here vs 4 there" in (rank1.mismatch(other_model) or "")
    assert rank1.head_slice_problem(range(1, 2), "there") is None
    problem = rank1.head_slice_problem(range(0, 2), "there")
    assert problem == "KV heads 0-1 asked of the pool there, which holds KV heads 1-1 of 2"
    assert rank1.slice_nbytes(1) == (rank1.page_nbytes, 0)
    assert whole.slice_nbytes(1) == (whole.page_nbytes // 2, 0)


def make_pool(dtype: str, heads: range, device: str = "cpu") -> KVPool:
    layout = KVLayout(
        DTYPES[dtype], 8, 3, len(heads), 16, first_kv_head=heads.start,
        model_kv_heads=MODEL_KV_HEADS,
    )  # fmt: skip
    return KVPool(layout, NUM_PAGES, device)


def run_until_done(sender, receiver, read_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sender.poll()
        results = receiver.poll()
        if results:
            assert [r.transfer_id for r in results] == [read_id]
            return results[0]
        time.sleep(0.001)
    raise AssertionError(f"{read_id} did not end in {timeout}s")


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def tensors(pool: KVPool) -> list[torch.Tensor]:
    """The pool's data and scales as integers of their width: compared bit for bit, with the
    head axis where it is."""
    return [t.view(BITS[t.element_size()]) for t in (pool.data, pool.scales) if t is not None]


@pytest.mark.parametrize(
    "backend",
    [
        *backend_params("zmq", "nixl"),
        # Device pools: the ZMQ sender stages its gather through host memory, the receiver
        # scatters the frames on the device.
        pytest.param("zmq:cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
    ],
)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    ("sender_heads", "receiver_heads", "heads"),
    [
        (range(0, 4), range(2, 3), range(2, 3)),  # a whole sender, a rank of one head
        (range(2, 4), range(0, 4), range(2, 4)),  # a rank's heads into a whole pool
        (range(1, 3), range(2, 4), range(2, 3)),  # overlapping runs
        (range(2, 4), range(2, 4), range(2, 4)),  # equal runs: pages move whole
    ],
)
def test_a_read_writes_exactly_its_heads(backend, dtype, sender_heads, receiver_heads, heads):
    backend, _, device = backend.partition(":")
    source = make_pool(dtype, sender_heads, device or "cpu")
    target = make_pool(dtype, receiver_heads, device or "cpu")
    fill_pool(source, seed=1)
    fill_pool(target, seed=2)
    before = [t.clone() for t in tensors(target)]
    sender = create_sender(backend, source, "prefill-rank")
    receiver = create_receiver(backend, target, "decode-rank")
    try:
        src_pages, dst_pages = [3, 4, 5, 9], [0, 7, 8, 2]
        params = sender.publish("req", src_pages, lease_seconds=30)
        receiver.start_read("req@0", "req", params, heads, dst_pages, timeout=20)
        result = run_until_done(sender, receiver, "req@0")
        assert result.ok, result.error
        ours = slice(heads.start - receiver_heads.start, heads.stop - receiver_heads.start)
        theirs = slice(heads.start - sender_heads.start, heads.stop - sender_heads.start)
        for got, old, sent in zip(tensors(target), before, tensors(source), strict=True):
            expected = old.clone()
            expected[dst_pages, :, :, :, ours] = sent[src_pages, :, :, :, theirs]
            assert torch.equal(got, expected)  # those heads of those pages, nothing else
        # A read does not end the lease: the group's release does.
        assert sender.poll() == []
        receiver.release(params, "req", ok=True)
        deadline = time.monotonic() + 30
        while (released := sender.poll()) == [] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert released == ["req"]
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("backend", backend_params("zmq", "nixl"))
def test_a_read_of_heads_the_sender_lacks_fails_with_the_reason(backend):
    source, target = make_pool("f32", range(0, 2)), make_pool("f32", range(0, 4))
    sender = create_sender(backend, source, "prefill-rank")
    receiver = create_receiver(backend, target, "decode-rank")
    try:
        params = sender.publish("req", [1, 2], lease_seconds=30)
        with pytest.raises(TransferError, match="KV heads 0-4 asked of the pool here"):
            receiver.start_read("bad", "req", params, range(0, 5), [0, 1], timeout=10)
        receiver.start_read("req@0", "req", params, range(1, 3), [0, 1], timeout=10)
        result = run_until_done(sender, receiver, "req@0")
        assert not result.ok
        assert "KV heads 1-2 asked of the pool there, which holds KV heads 0-1 of 4" in (
            result.error or ""
        )
    finally:
        receiver.close()
        sender.close()


def whole_pool(dtype: str) -> KVPool:
    return KVPool(KVLayout(DTYPES[dtype], 8, 3, MODEL_KV_HEADS, 16), NUM_PAGES, "cpu")


@pytest.mark.parametrize("backend", backend_params("zmq", "nixl"))
def test_a_whole_decode_pool_takes_each_head_from_its_prefill_rank(backend):
    """A decode worker at TP 1 (no followers) fetching from a prefill worker at TP 2: one read
    per prefill rank, then the one release, to rank 0 alone, once both reads are in."""
    ranks = [make_pool("fp8", range(0, 2)), make_pool("fp8", range(2, 4))]
    for seed, pool in enumerate(ranks):
        fill_pool(pool, seed=seed + 3)
    target = whole_pool("fp8")
    senders = [create_sender(backend, pool, f"prefill.rank{i}") for i, pool in enumerate(ranks)]
    receiver = group_receiver(backend, target, "decode", "127.0.0.1", followers=None, secret=None)
    try:
        src_pages, dst_pages = [1, 2, 3], [6, 4, 5]
        params, _ = (s.publish("req", src_pages, lease_seconds=30) for s in senders)
        params.ranks = [
            RankSender(s.endpoint, f"prefill.rank{i}", 2 * i, 2) for i, s in enumerate(senders)
        ]
        receiver.start_fetch("req", params, dst_pages, timeout=20)
        deadline, results, released = time.monotonic() + 30, [], [[], []]
        while not (results and released[0]) and time.monotonic() < deadline:
            for sender, freed in zip(senders, released, strict=True):
                freed += sender.poll()
            results += receiver.poll()
            time.sleep(0.001)
        assert [(r.transfer_id, r.ok, r.num_pages) for r in results] == [("req", True, 3)]
        assert released == [["req"], []]  # rank 1's lease is rank 0's to end
        for i, got in enumerate(tensors(target)):
            sent = torch.cat([tensors(pool)[i][src_pages] for pool in ranks], dim=4)
            assert torch.equal(got[dst_pages], sent)
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


def test_a_decode_group_no_prefill_rank_can_serve_is_refused():
    target = make_pool("f32", range(2, 4))  # a rank's pool: fetches go through the group path
    receiver = group_receiver("zmq", target, "decode", "127.0.0.1", followers=None, secret=None)
    try:
        params = TransferParams("zmq", "tcp://127.0.0.1:1", "prefill", [1], time.time() + 30)
        params.ranks = [RankSender("tcp://127.0.0.1:1", "prefill", 0, 2)]
        with pytest.raises(TransferError, match=r"cannot be served: KV heads \[2, 3\]"):
            receiver.start_fetch("req", params, [0], timeout=10)
    finally:
        receiver.close()
