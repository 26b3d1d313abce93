"""`pdserve up`'s arguments: flags of one role reach only that role's workers, and parse there."""

from __future__ import annotations

import pytest

from decode_worker.worker import build_parser as decode_parser
from pdserve.launcher import build_parser, core_shares, role_flags
from prefill_worker.worker import build_parser as prefill_parser

ROLE_PARSERS = {"prefill": prefill_parser, "decode": decode_parser}
BASE = ["--router", "tcp://127.0.0.1:1", "--model", "m"]


def test_role_flags_go_to_their_role_only():
    args, rest = build_parser().parse_known_args(
        ["--no-ship-chunks", "--kv-lease-seconds", "5", "--kv-fetch-timeout", "3", "--seed", "2"]
    )
    assert rest == ["--seed", "2"]  # for every worker
    assert role_flags(args, "prefill") == ["--kv-lease-seconds", "5.0", "--no-ship-chunks"]
    assert role_flags(args, "decode") == ["--kv-fetch-timeout", "3.0"]
    prefill = prefill_parser().parse_args([*BASE, *role_flags(args, "prefill")])
    assert (prefill.ship_chunks, prefill.kv_lease_seconds) == (False, 5.0)
    decode = decode_parser().parse_args([*BASE, *role_flags(args, "decode")])
    assert decode.kv_fetch_timeout == 3.0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_role_flags_by_default(role):
    args, _ = build_parser().parse_known_args([])
    assert role_flags(args, role) == []
    assert ROLE_PARSERS[role]().parse_args(BASE).kv_transfer == "zmq"


def test_core_shares_are_disjoint_and_cover_the_cores():
    shares = core_shares(2)
    assert len(shares) == 2 and all(shares)
    assert not shares[0] & shares[1] or len(set().union(*shares)) == 1
