"""Wire messages shared by every pdserve process: typed dataclasses carried as msgpack maps.

A message is a slotted dataclass registered under a ``type`` string::

    @message("router.abort")
    @dataclass(slots=True)
    class Abort(Message):
        request_id: str

``encode`` writes a msgpack map holding ``type`` and the fields; ``decode`` is strict and turns
anything that is not exactly such a map into a ``ProtocolError``: oversized frames, bad msgpack,
msgpack extension types (nothing on the wire is ever unpickled or otherwise constructed from
code-bearing data), unknown types, missing or extra fields, and fields whose value does not match
the dataclass annotation. Supported annotations: ``int`` (never ``bool``), ``float`` (an ``int``
is accepted), ``str``, ``bool``, ``bytes``, ``dict`` / ``dict[str, X]``, ``dict[int, X]``
(carried as ``[key, value]`` pairs: msgpack peers refuse integer map keys), ``list[X]``,
``X | None``, and nested dataclasses (carried as maps of their fields, without a ``type``). A
dataclass whose constructor (``__post_init__``) refuses the values raises ``ProtocolError`` too.

A field with a default may be left out of a frame; the default applies.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

# 2: workers batch a step's token deltas into one TokenDeltas frame. 3: logit bias and prompt
# logprobs. 4: token deltas carry the worker's stage times. 5: typed sampling params, KV layouts
# and transfer params (maps of checked fields instead of free-form maps); kvtransfer messages
# name their transfer id ``transfer_id``; an unknown prefill_done_at is None. 6: a KV page is
# called a page in every field (``page_size``, ``page_ids``, ``num_pages``, ``num_free_pages``);
# a registration carries its worker process's incarnation. 7: transfer params list a
# tensor-parallel prefill worker's ranks; a fetch names the KV heads it asks for. 8: a step's
# one-token deltas travel as columns of TokenDeltas. 9: heartbeats carry the worker's steps,
# the progress of each request it holds, and its prefill and finishing rates; sampling params
# carry a structured-output spec. 10: heartbeats carry the worker's step time, tokens and rows
# summed over its steps. 11: a prefill worker registers its KV side channel, a DecodeRequest may
# name a prefill worker holding a prefix of its prompt, and a decode worker fetches such a prefix
# by its page hashes (PrefixRequest, PrefixOffer).
PROTOCOL_VERSION = 11

# Control messages are small; a frame above this is refused before it is parsed. Sockets that
# carry larger control frames (e.g. a NIXL agent's metadata) pass their own limit.
MAX_FRAME_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A frame that is not a valid pdserve message."""


class Message:
    """Base of every wire message; ``TYPE`` is set by the ``message`` decorator."""

    __slots__ = ()
    TYPE: typing.ClassVar[str]


M = TypeVar("M", bound=type)

_TYPES: dict[str, type[Message]] = {}
# One converter per dataclass, built on first use (annotations may name classes defined later).
_Converter = Callable[[Any, str], Any]
_FIELD_CONVERTERS: dict[type, dict[str, _Converter]] = {}
_WRITERS: dict[type, Callable[[Any], dict[str, Any]]] = {}
# Values that travel as they are.
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def message(type_name: str) -> Callable[[M], M]:
    """Register a slotted message dataclass under ``type_name`` (unique across pdserve)."""

    def register(cls: M) -> M:
        if not dataclasses.is_dataclass(cls) or "__slots__" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} must be a @dataclass(slots=True)")
        if not issubclass(cls, Message):
            raise TypeError(f"{cls.__name__} must subclass Message")
        if type_name in _TYPES and _TYPES[type_name] is not cls:
            raise TypeError(f"message type {type_name!r} is already {_TYPES[type_name].__name__}")
        cls.TYPE = type_name
        _TYPES[type_name] = cls
        return cls

    return register


def registered_types() -> dict[str, type[Message]]:
    return dict(_TYPES)


def encode(msg: Message) -> bytes:
    cls = type(msg)
    if _TYPES.get(getattr(cls, "TYPE", "")) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message")
    fields = to_wire(msg)
    if "type" in fields:
        raise TypeError(f"{cls.__name__} may not have a field named 'type'")
    return msgpack.packb({"type": cls.TYPE, **fields}, use_bin_type=True)


def decode(frame: bytes | bytearray | memoryview, max_size: int = MAX_FRAME_BYTES) -> Message:
    """Parse one frame into its message; any defect raises ``ProtocolError``."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_size:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_size}")
    try:
        raw = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ProtocolError(f"bad msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"a message must be a map, got {type(raw).__name__}")
    type_name = raw.pop("type", None)
    if not isinstance(type_name, str):
        raise ProtocolError("message has no string 'type'")
    cls = _TYPES.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name[:64]!r}")
    return from_wire(cls, raw)


def to_wire(obj: Any) -> dict[str, Any]:
    """A dataclass as the plain map that travels on the wire (nested dataclasses included)."""
    return _writer(type(obj))(obj)


def from_wire(cls: type[Any], raw: Any, where: str | None = None) -> Any:
    """Build ``cls`` from a wire map, checking every field against its annotation."""
    where = where or cls.__name__
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    converters = _converters(cls)
    extra = raw.keys() - converters.keys()
    if extra:
        raise ProtocolError(f"{where}: unexpected fields {sorted(map(str, extra))[:8]}")
    values = {}
    for name, convert in converters.items():
        if name in raw:
            values[name] = convert(raw[name], f"{where}.{name}")
        elif not _has_default(cls, name):
            raise ProtocolError(f"{where}: missing field {name!r}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # the dataclass's own checks (__post_init__)
        raise ProtocolError(f"{where}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _plain(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_wire(value)
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _SCALARS else _plain(v) for v in value]
    return value


def _writer(cls: type) -> Callable[[Any], dict[str, Any]]:
    """``cls``'s ``to_wire``, written once per class as one dict display over its fields (as
    ``dataclasses`` writes ``__init__``): a worker encodes a delta per sequence per step, and a
    generic walk over fields and values cost several microseconds a delta."""
    writer = _WRITERS.get(cls)
    if writer is None:
        hints = typing.get_type_hints(cls)
        items = ", ".join(
            f"{f.name!r}: {_field_writer(hints[f.name], 'obj.' + f.name)}"
            for f in dataclasses.fields(cls)
        )
        namespace = {"to_wire": to_wire, "_pairs": _pairs, "_plain": _plain}
        exec(f"def write(obj):\n    return {{{items}}}\n", namespace)
        writer = _WRITERS[cls] = namespace["write"]
    return writer


def _field_writer(hint: Any, value: str) -> str:
    """The expression that turns ``value``, annotated ``hint``, into its wire form."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return f"(None if {value} is None else {_field_writer(inner, value)})"
    if hint in _SCALARS:
        return value
    if _is_int_keyed_dict(hint):
        return f"_pairs({value})"
    if origin is list and args and args[0] in _SCALARS:
        return value  # msgpack writes a list (or tuple) of plain values as it is
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return f"[to_wire(item) for item in {value}]"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"to_wire({value})"
    return f"_plain({value})"


def _pairs(mapping: dict[int, Any]) -> list[list[Any]]:
    return [[key, _plain(value)] for key, value in mapping.items()]


def _is_int_keyed_dict(hint: Any) -> bool:
    return typing.get_origin(hint) is dict and typing.get_args(hint)[:1] == (int,)


def _has_default(cls: type[Any], name: str) -> bool:
    field = cls.__dataclass_fields__[name]
    return (
        field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )


def _converters(cls: type) -> dict[str, _Converter]:
    converters = _FIELD_CONVERTERS.get(cls)
    if converters is None:
        hints = typing.get_type_hints(cls)
        converters = {
            f.name: _converter_for(hints[f.name]) for f in dataclasses.fields(cls) if f.init
        }
        _FIELD_CONVERTERS[cls] = converters
    return converters


def _converter_for(hint: Any) -> _Converter:
    """A function that checks (and, for float and nested dataclasses, converts) one value."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is int:
        return _check_int
    if hint is float:
        return _check_float
    if hint in (str, bool, bytes):
        return _check_exact(hint)
    if _is_int_keyed_dict(hint):
        return _check_pairs(_converter_for(args[1]))
    if hint is dict or (origin is dict and args[0] is str):
        value_converter = _converter_for(args[1]) if args else None
        return _check_dict(value_converter)
    if origin is list:
        return _check_list(_converter_for(args[0]))
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(options) == 1:
            return _check_optional(_converter_for(options[0]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value, where: from_wire(hint, value, where)
    raise TypeError(f"unsupported message field annotation {hint!r}")


def _expected(where: str, what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {what}, got {type(value).__name__}")


def _check_int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise _expected(where, "int", value)
    return value


def _check_float(value: Any, where: str) -> float:
    if type(value) not in (int, float):
        raise _expected(where, "float", value)
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range (not from msgpack, whose ints are 64-bit)
        raise ProtocolError(
            f"{where}: an int of {value.bit_length()} bits is beyond a float"
        ) from None


def _check_exact(kind: type) -> _Converter:
    def check(value: Any, where: str) -> Any:
        if type(value) is not kind:
            raise _expected(where, kind.__name__, value)
        return value

    return check


def _check_list(item: _Converter) -> _Converter:
    def check(value: Any, where: str) -> list:
        if type(value) is not list:
            raise _expected(where, "list", value)
        return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]

    return check


def _check_dict(item: _Converter | None) -> _Converter:
    def check(value: Any, where: str) -> dict:
        if type(value) is not dict:
            raise _expected(where, "map", value)
        if item is None:
            _check_plain(value, where, depth=0)
            return value
        out = {}
        for key, v in value.items():
            if type(key) is not str:
                raise _expected(f"{where} key", "str", key)
            out[key] = item(v, f"{where}[{key[:32]!r}]")
        return out

    return check


def _check_pairs(value_converter: _Converter) -> _Converter:
    def check(value: Any, where: str) -> dict:
        if type(value) is not list:
            raise _expected(where, "list of [key, value] pairs", value)
        out = {}
        for i, pair in enumerate(value):
            if type(pair) is not list or len(pair) != 2:
                raise _expected(f"{where}[{i}]", "[key, value] pair", pair)
            key = _check_int(pair[0], f"{where}[{i}] key")
            if key in out:
                raise ProtocolError(f"{where}: key {key} appears twice")
            out[key] = value_converter(pair[1], f"{where}[{key}]")
        return out

    return check


_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
_MAX_PLAIN_DEPTH = 32


def _check_plain(value: Any, where: str, depth: int) -> None:
    """An untyped map may hold only plain msgpack values (no timestamps or other objects)."""
    if depth > _MAX_PLAIN_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {_MAX_PLAIN_DEPTH}")
    kind = type(value)
    if kind is dict:
        for v in value.values():
            _check_plain(v, where, depth + 1)
    elif kind is list:
        for v in value:
            _check_plain(v, where, depth + 1)
    elif kind not in _PLAIN_SCALARS:
        raise _expected(where, "plain msgpack values", value)


def _check_optional(inner: _Converter) -> _Converter:
    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return check
