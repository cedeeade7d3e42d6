"""The token plane's frames, both ways: data only, never code.

A frame is a 4-byte big-endian length and a msgpack array of `[tag, kind, payload]` items, the
tag naming one stream (the router picks it). Node to router:
- `DELTA`: a `TokenDelta`'s fields in declaration order;
- `ENDED`: the node's stream ran out (payload nil);
- `FAILED`: the exception that ended it, as `[class name, [arguments]]` — one of `ERRORS` (the
  classes the router tells apart: a refusal is the client's 400, a dead engine a retry), any other
  as a `RuntimeError` naming it.
Router to node (`encode_orders` / `decode_orders`):
- `OPEN`: run a leg (pdserve_core/engine/legs.py) and stream its deltas under the tag; the payload
  is `[leg kind, field, ...]` in the leg's declaration order, its `params` (vLLM's
  `SamplingParams`, a msgspec struct) as msgspec msgpack bytes, decoded by the node into the type
  it names (`leg_from`);
- `CANCEL`: stop that stream's leg (payload nil).
msgpack yields only numbers, strings, bytes, lists and maps: a frame that says anything else
fails to decode, and nothing a peer sends is ever unpickled (docs/design.md, "Data, not code").
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgpack
import msgspec

from pdserve_core.engine.legs import Decode, Leg, Prefill, Whole
from pdserve_core.engine.types import EngineDown, KVLoadFailed, RequestRejected, TokenDelta

END = None
"""The item that ends a stream: the node's generator ran out."""
DELTA, ENDED, FAILED = 0, 1, 2
OPEN, CANCEL = 0, 1
LEGS: dict[str, type] = {cls.KIND: cls for cls in (Whole, Prefill, Decode)}
DELTA_FIELDS = tuple(f.name for f in fields(TokenDelta))
ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        RequestRejected,
        EngineDown,
        KVLoadFailed,
        ValueError,
        TypeError,
        TimeoutError,
        RuntimeError,
    )
}
"""The exceptions a stream's end arrives as (by name); a subclass crosses as the first of these
it derives from (vLLM's validation errors are ValueErrors, as vLLM's server reads them)."""


class FrameError(ValueError):
    """A frame that is not what the token plane sends."""


def _arguments(error: BaseException, cls: type[BaseException]) -> list[str]:
    if cls is KVLoadFailed:
        return [error.reason, error.detail]
    if cls in (RequestRejected, EngineDown):
        return [error.message]
    return [str(error)]


def carried(error: BaseException) -> type[BaseException] | None:
    """The first of `ERRORS` the exception's class derives from (what it crosses as), if any."""
    return next((c for c in type(error).__mro__ if ERRORS.get(c.__name__) is c), None)


def describe(error: BaseException, where: str) -> list[Any]:
    """`[class name, [arguments]]` of the exception a stream ended with."""
    cls = carried(error)
    if cls is None:
        return ["RuntimeError", [f"{where} failed: {error!r}"]]
    return [cls.__name__, _arguments(error, cls)]


def rebuild(name: Any, arguments: Any) -> BaseException:
    """The exception `describe` told: one of `ERRORS` with its arguments, else a RuntimeError."""
    cls = ERRORS.get(name) if isinstance(name, str) else None
    if cls is None or not isinstance(arguments, list):
        return RuntimeError(f"the node's stream failed: {name!r} {arguments!r}"[:2000])
    if not all(isinstance(a, str) for a in arguments):
        return RuntimeError(f"{name}: {arguments!r}"[:2000])
    try:
        return cls(*arguments)
    except TypeError:
        return RuntimeError(f"{name}: {arguments!r}"[:2000])


def encode(batch: list[tuple[int, Any]], where: str = "the node") -> bytes:
    """One frame of (tag, `TokenDelta` | `END` | exception) items."""
    items = []
    for tag, item in batch:
        if item is END:
            items.append((tag, ENDED, None))
        elif isinstance(item, BaseException):
            items.append((tag, FAILED, describe(item, where)))
        else:
            items.append((tag, DELTA, [getattr(item, name) for name in DELTA_FIELDS]))
    return _pack(items)


def _pack(items: list) -> bytes:
    """A frame: the length, then the items as msgpack."""
    data = msgpack.packb(items, use_bin_type=True)
    return len(data).to_bytes(4, "big") + data


def _unpack(data: bytes) -> list:
    """A frame's items as a list; `FrameError` for what is not msgpack, or not a list."""
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack's own errors: ExtraData, FormatError, StackError, ...
        raise FrameError(f"a frame that is not msgpack: {error!r}") from None
    if not isinstance(items, list):
        raise FrameError("a frame that is not a list of items")
    return items


def decode(data: bytes) -> list[tuple[int, Any]]:
    """A frame's (tag, item) pairs; `FrameError` for anything `encode` would not have made."""
    out = []
    for item in _unpack(data):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int)):
            raise FrameError("an item that is not [tag, kind, payload]")
        tag, kind, payload = item
        if kind == DELTA:
            if not isinstance(payload, list) or len(payload) != len(DELTA_FIELDS):
                raise FrameError("a delta without its fields")
            out.append((tag, TokenDelta(*payload)))
        elif kind == ENDED:
            out.append((tag, END))
        elif kind == FAILED:
            if not isinstance(payload, list) or len(payload) != 2:
                raise FrameError("a failure without [name, arguments]")
            out.append((tag, rebuild(*payload)))
        else:
            raise FrameError(f"an item of unknown kind {kind!r}")
    return out


# -- router to node: the legs to run, and the streams to stop -------------------------------------


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)


FIELD_CHECKS: dict[str, Any] = {
    "str": lambda value: isinstance(value, str),
    "int": lambda value: type(value) is int,
    "bool": lambda value: isinstance(value, bool),
    "list[int]": _is_tokens,
    "dict[str, Any]": lambda value: (
        isinstance(value, dict) and all(isinstance(key, str) for key in value)
    ),
}
"""What each leg field's value must be on the wire, by the field's annotation (`params` aside)."""


def leg_payload(leg: Leg) -> list[Any]:
    """`[kind, field, ...]` of a leg, its `params` as msgspec msgpack bytes."""
    return [leg.KIND] + [
        msgspec.msgpack.encode(leg.params) if f.name == "params" else getattr(leg, f.name)
        for f in fields(leg)
    ]


def leg_from(payload: Any, params_type: Any) -> Leg:
    """The leg `leg_payload` told, its `params` decoded as `params_type` (vLLM's `SamplingParams`
    on a node: typed fields only, `extra_args` plain data); `FrameError` for anything else."""
    if not (isinstance(payload, list) and payload and payload[0] in LEGS):
        raise FrameError("a leg that is not [kind, field, ...] of a known kind")
    cls = LEGS[payload[0]]
    declared = fields(cls)
    if len(payload) != 1 + len(declared):
        raise FrameError(f"a {cls.__name__} leg with {len(payload) - 1} fields")
    values = {}
    for f, value in zip(declared, payload[1:], strict=True):
        if f.name == "params":
            if not isinstance(value, bytes):
                raise FrameError("a leg whose params are not bytes")
            try:
                value = msgspec.msgpack.decode(value, type=params_type)
            except Exception as error:
                # msgspec's DecodeError and ValidationError, and the params' own checks (vLLM's
                # __post_init__ raises its own VLLMValidationError)
                raise FrameError(f"a leg whose params do not decode: {error}") from None
        elif not FIELD_CHECKS[str(f.type)](value):
            raise FrameError(f"a {cls.__name__} leg whose {f.name} is not {f.type}")
        values[f.name] = value
    return cls(**values)


def encode_orders(batch: list[tuple[int, int, Any]]) -> bytes:
    """One frame of router-to-node (tag, `OPEN` | `CANCEL`, payload) items."""
    return _pack(batch)


def decode_orders(data: bytes) -> list[tuple[int, int, Any]]:
    """A router frame's (tag, kind, payload) items, the payloads not yet read (`leg_from`);
    `FrameError` for anything else."""
    items = _unpack(data)
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and type(item[0]) is int
            and item[1] in (OPEN, CANCEL)
        ):
            raise FrameError("an item that is not [tag, OPEN | CANCEL, payload]")
    return items
