"""A prefill group's GroupSender and a decode group's GroupReceiver with real follower processes
(ranks spawned as a tensor-parallel worker spawns them, holding only a KV pool, no model): each
decode rank must end up with exactly its heads of the prefill ranks' pages, and prefill rank 0's
lease must end only once every decode rank has its copy."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from kv_sender_process import fill_pool
from optional_backends import backend_params

from common.engine.kv_pool import KVPool
from common.engine.tp_group import FollowerRank, FollowerRanks, RankCommand, serve_steps
from common.kv_layout import KVLayout
from common.model.parallel import TensorParallel
from kvtransfer.tp_group import group_receiver, group_sender

MODEL_KV_HEADS = 4
NUM_PAGES = 16
SRC_PAGES, DST_PAGES = [2, 3, 4, 11], [9, 1, 5, 6]


def rank_pool(size: int, rank: int, seed: int | None) -> KVPool:
    """Rank ``rank`` of ``size``'s pool of FP8 pages (with scales); random bytes unless
    ``seed`` is None."""
    heads = TensorParallel(rank, size).kv_heads(MODEL_KV_HEADS)
    layout = KVLayout("float8_e4m3fn", 8, 2, len(heads), 16, first_kv_head=heads.start,
                      model_kv_heads=MODEL_KV_HEADS if size > 1 else None)  # fmt: skip
    pool = KVPool(layout, NUM_PAGES, "cpu")
    if seed is not None:
        fill_pool(pool, seed + rank)
    return pool


class SendPool(RankCommand):
    """Report this rank's pool, as bytes."""

    def run(self, rank: FollowerRank) -> None:
        rank.report([t.view(torch.uint8).clone() for t in (rank.pool.data, rank.pool.scales)])


def follower_main(size: int, seed: int | None, rank: int, port: int, pipe) -> None:
    serve_steps(pipe, lambda runs: None, FollowerRank(rank, rank_pool(size, rank, seed), pipe))


def pools_of(group: FollowerRanks | None, own: KVPool) -> list[list[torch.Tensor]]:
    """Every rank's pool as bytes, rank 0 first."""
    pools = [[t.view(torch.uint8) for t in (own.data, own.scales)]]
    for rank in range(1, group.size if group is not None else 1):
        group.command(rank, SendPool())
        pools.append(group.wait_report(rank, 30))
    return pools


def spawn(size: int, seed: int | None) -> FollowerRanks | None:
    return FollowerRanks(functools.partial(follower_main, size, seed), size) if size > 1 else None


@pytest.mark.slow  # spawns up to two processes
@pytest.mark.parametrize("backend", backend_params("zmq", "nixl"))
# (2, 1): one decode rank reads two prefill ranks; (2, 4): four decode ranks each read a slice.
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (2, 4)])
def test_every_decode_rank_gets_exactly_its_heads(backend, prefill_tp, decode_tp):
    prefill_group, decode_group = spawn(prefill_tp, seed=10), spawn(decode_tp, seed=None)
    prefill_pool, decode_pool = rank_pool(prefill_tp, 0, 10), rank_pool(decode_tp, 0, None)
    sender = group_sender(backend, prefill_pool, "prefill", "127.0.0.1", prefill_group, None)
    receiver = group_receiver(backend, decode_pool, "decode", "127.0.0.1", decode_group, None)
    try:
        params = sender.publish("req", SRC_PAGES, lease_seconds=30)
        assert len(params.ranks) == (prefill_tp if prefill_tp > 1 else 0)
        receiver.start_fetch("req", params, DST_PAGES, timeout=30)
        results, released = [], []
        deadline = time.monotonic() + 60
        while not results and time.monotonic() < deadline:
            released += sender.poll()
            results += receiver.poll()
            time.sleep(0.001)
        [result] = results
        assert result.ok, result.error
        while not released and time.monotonic() < deadline:
            released += sender.poll()
            time.sleep(0.001)
        assert released == ["req"]  # the one lease, ended once every decode rank held its copy
        # Every head's bytes side by side, rank order = head order (heads are axis 4; a
        # float32 scale is 4 bytes of it).
        prefill_pools = pools_of(prefill_group, prefill_pool)
        sent = [torch.cat(t, dim=4) for t in zip(*prefill_pools, strict=True)]
        for rank, pool in enumerate(pools_of(decode_group, decode_pool)):
            heads = TensorParallel(rank, decode_tp).kv_heads(MODEL_KV_HEADS)
            fresh = pools_of(None, rank_pool(decode_tp, rank, None))[0]
            for got, whole, untouched in zip(pool, sent, fresh, strict=True):
                per_head = whole.shape[4] // MODEL_KV_HEADS
                ours = slice(heads.start * per_head, heads.stop * per_head)
                assert torch.equal(got[DST_PAGES], whole[SRC_PAGES][:, :, :, :, ours])
                others = [p for p in range(NUM_PAGES) if p not in DST_PAGES]
                assert torch.equal(got[others], untouched[others])  # no other page written
    finally:
        receiver.close()
        sender.close()
        for group in (prefill_group, decode_group):
            if group is not None:
                group.close()
