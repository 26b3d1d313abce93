"""The wire-message machinery: round trips, and a decoder that refuses everything else."""

from __future__ import annotations

import ast
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_layout import KVLayout
from common.messages import (
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
    message,
    registered_types,
)
from common.protocol import Heartbeat, PromptTokenLogprob, TokenDelta, TokenDeltas, TokenSample
from kvtransfer.messages import (
    FetchRequest,
    HandshakeReply,
    NixlAgentInfo,
    PageData,
    ReleasePages,
)

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Span:
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ValueError(f"length must be >= 0, got {self.length}")


@message("test.everything")
@dataclass(slots=True)
class Everything(Message):
    request_id: str
    count: int
    ratio: float
    flag: bool
    blob: bytes
    tokens: list[int]
    stops: list[str]
    extra: dict
    scores: dict[str, float]
    maybe: int | None
    span: Span
    spans: list[Span]
    note: str = "default"
    tags: list[str] = field(default_factory=list)
    biases: dict[int, float] = field(default_factory=dict)


def everything(**changes) -> Everything:
    fields = dict(
        request_id="r1",
        count=3,
        ratio=0.5,
        flag=True,
        blob=b"\x00\xff",
        tokens=[1, 2, 3],
        stops=["\n"],
        extra={"a": [1, {"b": None}]},
        scores={"x": 1.5},
        maybe=None,
        span=Span(0, 16),
        spans=[Span(1, 2), Span(3, 4)],
    )
    fields.update(changes)
    return Everything(**fields)


def frame(**fields) -> bytes:
    raw = {"type": "test.everything", **msgpack.unpackb(encode(everything()), raw=False)}
    raw.update(fields)
    return msgpack.packb(raw, use_bin_type=True)


def test_protocol_version():
    assert PROTOCOL_VERSION == 11


def test_a_heartbeat_lists_what_its_worker_holds_and_refuses_ragged_lists():
    beat = Heartbeat(
        "w", 1, 2, 30, 100, 0.5, num_steps=7, held_request_ids=["a", "b"], held_progress=[3, 0],
        prefill_tokens_per_s=1234.5, finished_per_s=0.25,
    )  # fmt: skip
    assert decode(encode(beat)) == beat
    raw = msgpack.unpackb(encode(beat))
    raw["held_progress"] = [3]
    with pytest.raises(ProtocolError, match="differ in length"):
        decode(msgpack.packb(raw))


def test_round_trip_of_a_step_of_token_deltas():
    deltas = [
        TokenDelta("a", [TokenSample(5, -0.1, [5, 6], [-0.1, -2.0])], 3),
        TokenDelta("b", [TokenSample(7)], 0, "stop", 12, 4, first=True),
        TokenDelta(
            "c",
            [TokenSample(9)],
            0,
            first=True,
            prompt_logprobs=[
                PromptTokenLogprob(3, -1.5, 2, [8], [-0.5]),
                PromptTokenLogprob(4, -0.1, 1, [], []),
            ],
        ),
    ]
    msg = TokenDeltas(deltas)
    assert decode(encode(msg)) == msg
    msg.add_token("d", 11, 7)
    msg.add_token("e", 12, 30)
    assert decode(encode(msg)) == msg
    assert msg.all_deltas() == [
        *deltas,
        TokenDelta("d", [TokenSample(11)], 7),
        TokenDelta("e", [TokenSample(12)], 30),
    ]


def test_token_columns_of_unequal_lengths_are_refused():
    raw = msgpack.unpackb(encode(TokenDeltas(token_request_ids=["a", "b"], token_ids=[1, 2],
                                             token_start_indices=[3, 4])))  # fmt: skip
    raw["token_ids"] = [1]
    with pytest.raises(ProtocolError, match="differ in length"):
        decode(msgpack.packb(raw))


def test_round_trip_of_every_field_kind():
    msg = everything(maybe=7, note="n", tags=["t"], biases={3: 0.5, -1: 2.0})
    assert decode(encode(msg)) == msg
    # msgpack peers refuse integer map keys: an int-keyed map travels as [key, value] pairs.
    assert msgpack.unpackb(encode(msg))["biases"] == [[3, 0.5], [-1, 2.0]]


def test_round_trip_of_kvtransfer_messages():
    info = NixlAgentInfo("agent", b"\x01" * 64, 1 << 40, None, "DRAM", 0)
    layout = KVLayout("bfloat16", page_size=16, num_layers=2, num_kv_heads=1, head_dim=64)
    for msg in [
        HandshakeReply(PROTOCOL_VERSION, "prefill-0", "i1", "nixl", layout, 128, info),
        HandshakeReply(PROTOCOL_VERSION, "prefill-0", "i1", "zmq", layout, 128),
        FetchRequest("r"),
        PageData("r", "i1", 0, 4, 368640, 0),
        ReleasePages("r", ok=False),
    ]:
        assert decode(encode(msg)) == msg


def test_float_accepts_int_and_fields_with_defaults_may_be_left_out():
    raw = msgpack.unpackb(frame(ratio=2), raw=False)
    del raw["note"], raw["tags"]
    msg = decode(msgpack.packb(raw, use_bin_type=True))
    assert msg.ratio == 2.0 and isinstance(msg.ratio, float)
    assert msg.note == "default" and msg.tags == []


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"count": True}, "Everything.count: expected int, got bool"),
        ({"count": 1.0}, "expected int, got float"),
        ({"ratio": "1"}, "Everything.ratio: expected float"),
        ({"flag": 1}, "Everything.flag: expected bool"),
        ({"blob": "text"}, "Everything.blob: expected bytes"),
        ({"tokens": [1, "2"]}, r"Everything.tokens\[1\]: expected int"),
        ({"tokens": (1, 2)}, None),  # msgpack has no tuples: arrives as a list, accepted
        ({"stops": "abc"}, "Everything.stops: expected list"),
        ({"extra": [1]}, "Everything.extra: expected map"),
        ({"scores": {"x": "high"}}, "expected float"),
        ({"maybe": "3"}, "Everything.maybe: expected int"),
        ({"span": {"start": 0}}, "Everything.span: missing field 'length'"),
        ({"span": [0, 16]}, "Everything.span: expected a map"),
        ({"spans": [{"start": 0, "length": 1, "end": 2}]}, "unexpected fields"),
        ({"request_id": None}, "expected str, got NoneType"),
        ({"span": {"start": 0, "length": -1}}, "Everything.span: length must be >= 0"),
        ({"biases": {"3": 0.5}}, "Everything.biases: expected list of"),
        ({"biases": [[3, 0.5, 1]]}, r"Everything.biases\[0\]: expected \[key, value\] pair"),
        ({"biases": [["3", 0.5]]}, r"Everything.biases\[0\] key: expected int"),
        ({"biases": [[3, 0.5], [3, 1.0]]}, "key 3 appears twice"),
        ({"biases": [[3, "high"]]}, r"Everything.biases\[3\]: expected float"),
        ({"bogus": 1}, r"unexpected fields \['bogus'\]"),
    ],
)
def test_field_checks(fields, words):
    if words is None:
        decode(frame(**fields))
        return
    with pytest.raises(ProtocolError, match=words):
        decode(frame(**fields))


def test_missing_field():
    raw = msgpack.unpackb(frame(), raw=False)
    del raw["count"]
    with pytest.raises(ProtocolError, match="missing field 'count'"):
        decode(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "bad msgpack"),
        (b"\xc1", "bad msgpack"),
        (msgpack.packb({"type": "kv.fetch_request", "transfer_id": "r"}) + b"\x00", "bad msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"request_id": "r"}), "no string 'type'"),
        (msgpack.packb({"type": 5}), "no string 'type'"),
        (msgpack.packb({"type": "nope"}), "unknown message type 'nope'"),
        (msgpack.packb({1: 2}), "bad msgpack"),  # non-string keys are refused by the parser
        (b"\x91" * 100_000 + b"\x00", "bad msgpack"),  # nesting deeper than the parser allows
    ],
)
def test_frames_that_are_not_messages(data, words):
    with pytest.raises(ProtocolError, match=words):
        decode(data)


def test_oversized_frame_is_refused_before_parsing():
    big = encode(everything(blob=b"x" * 2000))
    with pytest.raises(ProtocolError, match="exceeds the limit of 1000"):
        decode(big, max_size=1000)
    assert decode(big, max_size=len(big)).blob == b"x" * 2000


def test_extension_types_are_refused():
    """Nothing on the wire is turned into an object by anything but the field checks."""
    ext = msgpack.packb(
        {"type": "kv.fetch_request", "transfer_id": msgpack.ExtType(42, b"payload")}
    )
    with pytest.raises(ProtocolError, match="extension type 42"):
        decode(ext)
    timestamp = frame(extra={"when": msgpack.Timestamp(1, 0)})
    with pytest.raises(ProtocolError, match="plain msgpack values"):
        decode(timestamp)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    return names


def test_message_modules_never_import_pickle():
    for path in ["common/messages.py", "kvtransfer/messages.py", "kvtransfer/side_channel.py"]:
        unsafe = imported_modules(REPO / path) & {"pickle", "dill", "marshal", "shelve"}
        assert not unsafe, f"{path} imports {unsafe}"
    for path in (REPO / "kvtransfer").glob("*.py"):
        assert "_pyobj" not in path.read_text(), f"{path} uses pyzmq's pickling helpers"


def test_registration_rules():
    with pytest.raises(TypeError, match="slots"):

        @message("test.no_slots")
        @dataclass
        class NoSlots(Message):
            x: int

    with pytest.raises(TypeError, match="already"):

        @message("kv.fetch_request")
        @dataclass(slots=True)
        class Clash(Message):
            x: int

    with pytest.raises(TypeError, match="not a registered message"):
        encode(Span(1, 2))
    assert registered_types()["kv.fetch_request"] is FetchRequest


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(data):
    with contextlib.suppress(ProtocolError):
        decode(data)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
plain = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", *Everything.__slots__, "x"]), plain, max_size=14))
def test_random_maps_only_ever_raise_protocol_error(raw):
    raw.setdefault("type", "test.everything")
    try:
        msg = decode(msgpack.packb(raw, use_bin_type=True))
    except ProtocolError:
        return
    assert isinstance(msg, Everything)
