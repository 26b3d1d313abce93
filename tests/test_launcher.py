"""`pdserve up`'s arguments: flags of one role reach only that role's workers, and parse there;
and how it splits the cores between workers."""

from __future__ import annotations

import os

import pytest
import torch

from decode_worker.worker import build_parser as decode_parser
from pdserve import launcher
from pdserve.launcher import (
    Placement,
    build_parser,
    core_shares,
    gpu_available,
    gpu_shares,
    local_prefill_flags,
    names_a_gpu_backend,
    pair_core_loans,
    role_flags,
    router_flags,
    worker_env,
    worker_placements,
)
from prefill_worker.worker import build_parser as prefill_parser
from router.server import build_parser as router_parser

ROLE_PARSERS = {"prefill": prefill_parser, "decode": decode_parser}
BASE = ["--router", "tcp://127.0.0.1:1", "--model", "m"]


def test_role_flags_go_to_the_workers_that_read_them():
    """A role's engine flags go to the workers starting in it; both roles' transfer flags go to
    every worker, which may switch role live."""
    args, rest = build_parser().parse_known_args(
        [
            *("--no-ship-chunks", "--kv-lease-seconds", "5", "--kv-fetch-timeout", "3"),
            *("--max-prefill-tokens-while-decoding", "32", "--seed", "2"),
            *("--prefill-max-num-batched-tokens", "1024"),
        ]
    )
    assert rest == ["--seed", "2"]  # for every worker
    transfer = ["--kv-lease-seconds", "5.0", "--no-ship-chunks", "--kv-fetch-timeout", "3.0"]
    assert role_flags(args, "prefill") == [*transfer, "--max-num-batched-tokens", "1024"]
    assert role_flags(args, "decode") == [*transfer, "--max-prefill-tokens-while-decoding", "32"]
    prefill = prefill_parser().parse_args([*BASE, *role_flags(args, "prefill")])
    assert (prefill.ship_chunks, prefill.kv_lease_seconds) == (False, 5.0)
    assert prefill.max_num_batched_tokens == 1024 and prefill.kv_fetch_timeout == 3.0
    decode = decode_parser().parse_args([*BASE, *role_flags(args, "decode")])
    assert (decode.kv_fetch_timeout, decode.max_prefill_tokens_while_decoding) == (3.0, 32)
    assert (decode.ship_chunks, decode.kv_lease_seconds) == (False, 5.0)


def test_the_routers_flags_go_to_the_router_and_parse_there():
    args, rest = build_parser().parse_known_args(
        [
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
            *("--reasoning-parser", "qwen3", "--heartbeat-timeout", "4", "--seed", "2"),
            "--no-prefix-fetch",
        ]
    )
    assert rest == ["--seed", "2"]  # for every worker
    flags = router_flags(args)
    router = router_parser().parse_args(flags)
    assert (router.enable_auto_tool_choice, router.tool_call_parser) == (True, "hermes")
    assert (router.reasoning_parser, router.heartbeat_timeout) == ("qwen3", 4.0)
    assert router.prefix_fetch is False
    assert router_parser().parse_args([]).prefix_fetch is True
    assert router_flags(build_parser().parse_known_args([])[0]) == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_role_flags_by_default(role):
    args, _ = build_parser().parse_known_args([])
    assert role_flags(args, role) == []
    assert ROLE_PARSERS[role]().parse_args(BASE).kv_transfer == "zmq"


@pytest.mark.parametrize("flags, overflow", [(set(), "1024"), ({"avx512f", "amx_bf16"}, "4096")])
def test_local_prefill_defaults_without_a_gpu_only(monkeypatch, flags, overflow):
    """A prompt overflows to its decode worker behind ~2 s of queued prefill: 1024 tokens on a
    core's FMAs, 4096 where AMX runs the prefill GEMMs."""
    monkeypatch.setattr(launcher, "has_amx_bf16", lambda: "amx_bf16" in flags)
    args, _ = build_parser().parse_known_args([])
    assert local_prefill_flags(args, on_gpu=True) == []
    assert args.max_prefill_tokens_while_decoding is None
    assert local_prefill_flags(args, on_gpu=False) == [
        *("--local-prefill-overflow-tokens", overflow, "--remote-prefill-min-tokens", "128")
    ]
    assert role_flags(args, "decode") == ["--max-prefill-tokens-while-decoding", "16"]
    given = ["--remote-prefill-min-tokens", "32", "--max-prefill-tokens-while-decoding", "8"]
    args, _ = build_parser().parse_known_args(given)
    assert local_prefill_flags(args, on_gpu=False)[2:] == given[:2]
    assert local_prefill_flags(args, on_gpu=True) == given[:2]
    assert args.max_prefill_tokens_while_decoding == 8


@pytest.mark.parametrize("cores", [{0}, {0, 1}, {0, 1, 2}, {1, 3, 4, 6, 9}, set(range(16))])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4, 6])
def test_core_shares_are_disjoint_and_cover_the_cores(monkeypatch, cores, num_workers):
    """Whatever this machine has: the launcher's view of the cores is replaced by each case."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    shares = core_shares([1] * num_workers)
    assert len(shares) == num_workers and all(shares)
    assert set().union(*shares) == cores
    if num_workers <= len(cores):
        assert sum(len(share) for share in shares) == len(cores)  # disjoint
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # near-equal
    else:
        # More workers than cores: one core each, round-robin, so no core carries two more.
        assert all(len(share) == 1 for share in shares)
        load = [sum(core in share for share in shares) for core in cores]
        assert max(load) - min(load) <= 1


@pytest.mark.parametrize(
    "cores, sizes, expected",
    [
        # A core per rank where there are enough: a TP-2 worker gets two, its ranks one each.
        (range(3), [1, 2], [{0}, {1, 2}]),
        (range(4), [1, 2], [{0, 1}, {2, 3}]),
        (range(8), [2, 2], [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        (range(6), [1, 2], [{0, 1}, {2, 3, 4, 5}]),
        # Fewer cores than ranks: per worker, so no rank spins on another worker's core.
        (range(2), [1, 2], [{0}, {1}]),
        (range(3), [2, 2], [{0, 1}, {2}]),
    ],
)
def test_core_shares_give_every_rank_cores_of_its_own(monkeypatch, cores, sizes, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    assert core_shares(sizes) == expected


def test_gpu_shares_give_every_rank_a_gpu_of_its_own_as_far_as_they_go():
    assert gpu_shares([1, 2], ["0", "1", "2"]) == [["0"], ["1", "2"]]
    assert gpu_shares([1, 1, 2], ["0", "1", "2", "3"]) == [["0"], ["1"], ["2", "3"]]
    # More ranks than GPUs: round the list again, workers sharing, a worker's ranks never.
    assert gpu_shares([1, 1], ["0"]) == [["0"], ["0"]]
    assert gpu_shares([2, 2], ["a", "b", "c"]) == [["a", "b"], ["c", "a"]]
    with pytest.raises(ValueError, match="tensor-parallel size 2 needs 2 GPUs"):
        gpu_shares([1, 2], ["0"])


def test_up_places_each_worker_on_its_gpus_and_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    args, _ = build_parser().parse_known_args(
        ["--decode-tp", "2", "--gpus", "4,5,6", "--pin-cores"]
    )
    placements = worker_placements(args, ["prefill", "decode"], on_gpu=True)
    assert placements == [Placement({0, 1}, ["4"]), Placement({2, 3, 4, 5}, ["5", "6"])]
    env = worker_env(placements[1])
    assert (env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]) == ("5,6", "4")
    # Without a GPU and without --gpus: cores only, and no CUDA_VISIBLE_DEVICES of ours.
    args, _ = build_parser().parse_known_args([])
    [placement] = worker_placements(args, ["decode"], on_gpu=False)
    assert placement.gpus is None and placement.cores == set(range(6))
    assert worker_env(placement).get("CUDA_VISIBLE_DEVICES") == os.environ.get(
        "CUDA_VISIBLE_DEVICES"
    )
    # On GPUs by default: every GPU this process sees, as CUDA_VISIBLE_DEVICES names them.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b")
    args, _ = build_parser().parse_known_args(["--prefill", "2"])
    placements = worker_placements(args, ["prefill", "prefill", "decode"], on_gpu=True)
    assert [p.gpus for p in placements] == [["GPU-a"], ["GPU-b"], ["GPU-a"]]
    assert all(p.cores is None for p in placements)


def test_a_prefill_and_a_decode_worker_lend_each_other_their_cores(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_PLACES", raising=False)
    roles = ["prefill", "prefill", "decode"]
    placements = [Placement({0, 1}), Placement({2, 3}), Placement({4, 5})]
    flags = pair_core_loans(roles, [1, 1, 1], placements, str(tmp_path))
    path = str(tmp_path / "core-loan-0")
    assert flags == [
        ["--core-loan", path, "--core-loan-side", "0", "--lent-cores", "2"],
        [],  # a second prefill worker has no decode worker left to pair with
        ["--core-loan", path, "--core-loan-side", "1", "--lent-cores", "2"],
    ]
    assert [p.lent for p in placements] == [{4, 5}, None, {0, 1}]
    assert (tmp_path / "core-loan-0").read_bytes() == b"\x01\x01"  # busy until their loops say
    env = worker_env(placements[2])
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"]) == ("2", "{4},{5},{0},{1}")
    assert env["OMP_PROC_BIND"] == "close"
    assert "OMP_PLACES" not in worker_env(placements[1])


@pytest.mark.parametrize(
    "sizes, placements",
    [
        ([2, 1], [Placement({0, 1}), Placement({2})]),  # a worker of two ranks
        ([1, 1], [Placement({0}), Placement({0})]),  # fewer cores than workers: shared
        ([1, 1], [Placement(None), Placement(None)]),  # not pinned
    ],
)
def test_no_core_loan_across_ranks_shared_cores_or_unpinned_workers(tmp_path, sizes, placements):
    flags = pair_core_loans(["prefill", "decode"], sizes, placements, str(tmp_path))
    assert flags == [[], []] and all(p.lent is None for p in placements)
    assert not list(tmp_path.iterdir())


CPU_BUILD = """from typing import Optional

__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
"""


def test_a_torch_build_names_its_gpu_backend_or_none():
    """`pdserve up` reads torch's version.py instead of importing torch to ask for a GPU: a CPU
    build names neither CUDA nor ROCm, and whatever the file does not say plainly counts as a
    GPU build, so that torch itself is asked."""
    assert not names_a_gpu_backend(CPU_BUILD)
    assert names_a_gpu_backend(CPU_BUILD.replace("cuda: Optional[str] = None", "cuda = '13.0'"))
    assert names_a_gpu_backend(CPU_BUILD.replace("hip: Optional[str] = None", "hip = '6.4.1'"))
    assert names_a_gpu_backend(CPU_BUILD.replace("cuda: Optional[str] = None\n", ""))
    assert names_a_gpu_backend("")
    assert gpu_available() == torch.cuda.is_available()
