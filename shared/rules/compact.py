"""The compact encoding of a schedule stored in the Redis ``sched`` hash (pure).

Redis holds one entry per schedule, so every byte counts: keys are one or two letters and
defaults are left out. Two forms are read:

- the binary form, written since 2026-11-26: the version as a msgpack integer, then a msgpack
  map of the fields keyed by one-byte codes. Lua scripts read the version alone with
  ``cmsgpack.unpack_one``. Whole seconds are stored as seconds under their own keys, and a
  URL's ``http://`` or ``https://`` is a key rather than text: a typical schedule takes about
  half the bytes of the JSON form;
- the JSON form written before: ``{"v":<version>,...}``. It is what delivery messages embed
  (``as_json``), and values stored in that form stay readable until a rebuild, or the
  schedule's next write, stores them again in the binary form.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Literal

import msgpack

from shared.contract import codec
from shared.rules.exclusion import CronExclusion, Exclusion, RangeExclusion
from shared.rules.plan import (
    AfterCompletionRule,
    AmqpPlan,
    CronRule,
    IntervalRule,
    MisfirePolicy,
    MisfireRule,
    OnceRule,
    Plan,
    RetryRule,
    Rule,
    TargetPlan,
    WebhookPlan,
)

#: The form values are written in (both are always read).
Form = Literal["binary", "json"]

_DEFAULT_RETRY = RetryRule()
_DEFAULT_MISFIRE = MisfireRule()
_DEFAULT_TIMEOUT_MS = 10_000
_POLICY_CODES: dict[MisfirePolicy, str] = {"skip": "s", "fire_once": "o", "fire_all": "a"}
_POLICY_NAMES: dict[str, MisfirePolicy] = {code: name for name, code in _POLICY_CODES.items()}

#: Fields in milliseconds and the keys they take, in the binary form, when they are whole
#: seconds: msgpack writes a time in seconds in 5 bytes, in milliseconds in 9.
_SECONDS_KEYS = {"a": "A", "e": "F", "o": "O", "i": "I", "d": "D", "j": "J", "T": "Q"}
_MS_KEYS = {seconds: ms for ms, seconds in _SECONDS_KEYS.items()}
#: A webhook URL's scheme, as the key its remainder is stored under in the binary form.
_SCHEME_KEYS = {"http://": "h", "https://": "s"}
_SCHEMES = {key: scheme for scheme, key in _SCHEME_KEYS.items()}
#: The target's body: a JSON value in the JSON form, its encoded bytes in the binary form.
_BODY_BYTES = "b"
#: The binary form's map keys are these fields' positions here, one byte each where a
#: one-letter string takes two. Values already stored depend on this order: append only.
_BINARY_FIELDS = (
    *("c", "z", "i", "d", "o", "a", "e", "n", "j", "r", "f", "E", "P", "u", "M", "S", "X"),
    *("x", "k", "H", "b", "T", "K", "L", "A", "F", "O", "I", "D", "J", "Q", "h", "s"),
)
_BINARY_CODES = {field: code for code, field in enumerate(_BINARY_FIELDS)}


def _encode_rule(rule: Rule, out: dict[str, Any]) -> None:
    if isinstance(rule, CronRule):
        out["c"] = rule.expr
        if rule.timezone != "UTC":
            out["z"] = rule.timezone
    elif isinstance(rule, IntervalRule):
        out["i"] = rule.every_ms
    elif isinstance(rule, AfterCompletionRule):
        out["d"] = rule.delay_ms
    else:
        out["o"] = rule.at_ms


def _decode_rule(data: dict[str, Any]) -> Rule:
    if "c" in data:
        return CronRule(data["c"], data.get("z", "UTC"))
    if "i" in data:
        return IntervalRule(data["i"])
    if "d" in data:
        return AfterCompletionRule(data["d"])
    return OnceRule(data["o"])


def _encode_target(target: TargetPlan, out: dict[str, Any]) -> None:
    """Target fields sit beside the schedule's, with upper-case keys where they would clash."""
    if isinstance(target, WebhookPlan):
        out["u"] = target.url
        if target.method != "POST":
            out["M"] = target.method
        if target.success_codes is not None:
            out["S"] = sorted(target.success_codes)
        if target.secret_headers:
            out["X"] = dict(target.secret_headers)
    else:
        out["x"] = target.exchange
        if target.routing_key:
            out["k"] = target.routing_key
    if target.headers:
        out["H"] = dict(target.headers)
    if target.body is not None:
        # Kept as the encoded bytes here: the JSON form embeds them as a JSON value (escaping
        # a string of JSON would cost bytes), the binary form as msgpack bytes.
        out[_BODY_BYTES] = target.body
    if target.timeout_ms != _DEFAULT_TIMEOUT_MS:
        out["T"] = target.timeout_ms
    if target.rate_key is not None:
        out["K"] = target.rate_key
    if target.rate_per_s is not None:
        out["L"] = [target.rate_per_s, target.rate_burst]


def _decode_target(data: dict[str, Any]) -> TargetPlan:
    encoded = codec.dumps(data["B"]) if "B" in data else data.get(_BODY_BYTES)
    timeout_ms = data.get("T", _DEFAULT_TIMEOUT_MS)
    headers = tuple(data["H"].items()) if "H" in data else ()
    per_s, burst = data.get("L", (None, 1))
    if "u" in data:
        codes = data.get("S")
        return WebhookPlan(
            url=data["u"],
            method=data.get("M", "POST"),
            headers=headers,
            body=encoded,
            timeout_ms=timeout_ms,
            success_codes=frozenset(codes) if codes is not None else None,
            rate_key=data.get("K"),
            rate_per_s=per_s,
            rate_burst=burst,
            secret_headers=tuple(data["X"].items()) if "X" in data else (),
        )
    return AmqpPlan(
        exchange=data["x"],
        routing_key=data.get("k", ""),
        headers=headers,
        body=encoded,
        timeout_ms=timeout_ms,
        rate_key=data.get("K"),
        rate_per_s=per_s,
        rate_burst=burst,
    )


def encode(plan: Plan) -> bytes:
    """The binary form, as stored in Redis and PostgreSQL."""
    return _binary(plan.version, _fields(plan))


def encode_json(plan: Plan) -> bytes:
    """The JSON form (what earlier versions stored, and what delivery messages embed)."""
    return _json(plan.version, _fields(plan))


def _json(version: int, fields: dict[str, Any]) -> bytes:
    body = fields.pop(_BODY_BYTES, None)
    if body is not None:
        fields["B"] = codec.Fragment(body)
    return codec.dumps({"v": version, **fields})


def _fields(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _encode_rule(plan.rule, out)
    if plan.start_ms is not None:
        out["a"] = plan.start_ms
    if plan.end_ms is not None:
        out["e"] = plan.end_ms
    if plan.max_fires is not None:
        out["n"] = plan.max_fires
    if plan.jitter_ms:
        out["j"] = plan.jitter_ms
    if plan.retry != _DEFAULT_RETRY:
        retry = plan.retry
        out["r"] = [
            retry.max_attempts,
            retry.initial_ms,
            retry.multiplier,
            retry.max_ms,
            int(retry.full_jitter),
        ]
    if plan.misfire != _DEFAULT_MISFIRE:
        misfire = plan.misfire
        out["f"] = [
            _POLICY_CODES[misfire.policy],
            misfire.grace_ms,
            misfire.window_ms,
            misfire.limit,
        ]
    if plan.exclude:
        out["E"] = [
            item.expr if isinstance(item, CronExclusion) else [item.from_ms, item.to_ms]
            for item in plan.exclude
        ]
    if plan.pause_after_failures is not None:
        out["P"] = plan.pause_after_failures
    _encode_target(plan.target, out)
    return out


def _decode_exclusions(data: dict[str, Any]) -> tuple[Exclusion, ...]:
    items = data.get("E")
    if not items:
        # Most schedules have none: no generator to build and exhaust for them.
        return ()
    return tuple(
        CronExclusion(item) if isinstance(item, str) else RangeExclusion(item[0], item[1])
        for item in items
    )


_VERSION = re.compile(rb'\{"v":(\d+)')


def is_json(raw: bytes) -> bool:
    """Whether a stored value is in the JSON form. Two bytes, not one: msgpack packs the
    version 123 as the single byte ``{``, but a binary value's second byte is its map's header
    (0x80-0x8f, 0xde or 0xdf), never ``"`` (lib/plan_version.lua reads them the same way)."""
    return raw[:2] == b'{"'


def _binary(version: int, fields: dict[str, Any]) -> bytes:
    packed: dict[int, Any] = {}
    for key, value in fields.items():
        if key in _SECONDS_KEYS and value % 1000 == 0:
            packed[_BINARY_CODES[_SECONDS_KEYS[key]]] = value // 1000
        elif key == "u":
            scheme_key, rest = _url_field(value)
            packed[_BINARY_CODES[scheme_key]] = rest
        else:
            packed[_BINARY_CODES[key]] = value
    return _pack(version) + _pack(packed)


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


def _url_field(url: str) -> tuple[str, str]:
    for scheme, key in _SCHEME_KEYS.items():
        if url.startswith(scheme):
            return key, url[len(scheme) :]
    return "u", url


def _split_binary(raw: bytes) -> tuple[int, int]:
    """The version of a binary value and where its fields start."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(raw)
    version = unpacker.unpack()
    if not isinstance(version, int):
        raise ValueError("not a compact schedule")
    return version, unpacker.tell()


def _unpack_fields(raw: bytes) -> dict[str, Any]:
    """A binary value as the JSON form's fields (the body stays bytes, under its own key)."""
    version, start = _split_binary(raw)
    data: dict[str, Any] = {"v": version}
    for code, value in msgpack.unpackb(raw[start:], strict_map_key=False).items():
        key = _BINARY_FIELDS[code]
        if key in _MS_KEYS:
            data[_MS_KEYS[key]] = value * 1000
        elif key in _SCHEMES:
            data["u"] = _SCHEMES[key] + value
        else:
            data[key] = value
    return data


def version_of(raw: bytes) -> int:
    """The version of a stored value without decoding the rest (it always comes first)."""
    if is_json(raw):
        found = _VERSION.match(raw)
        if found is None:
            raise ValueError("not a compact schedule")
        return int(found.group(1))
    return _split_binary(raw)[0]


def with_version(raw: bytes, version: int) -> bytes:
    """The same schedule at another version, in the binary form (cheaper than encoding the
    plan again when the value is already binary)."""
    if is_json(raw):
        return encode(dataclasses.replace(decode(raw), version=version))
    return _pack(version) + raw[_split_binary(raw)[1] :]


def stored_form(raw: bytes, form: Form = "binary") -> bytes:
    """A value read in either form, in the form to write. A row written by an earlier version
    is stored again in the binary form: this is the migration a rebuild does."""
    if form == "json":
        return as_json(raw)
    return encode(decode(raw)) if is_json(raw) else raw


#: Values up to this size have their JSON form cached: a herd's schedules often share one
#: value, and a bound on each entry keeps large bodies from filling the cache.
_CACHED_UP_TO = 256


def as_json(raw: bytes) -> bytes:
    """The JSON form of a stored value, as delivery messages embed it."""
    if is_json(raw):
        return raw
    if len(raw) <= _CACHED_UP_TO:
        return _cached_json(raw)
    return _binary_as_json(raw)


def _binary_as_json(raw: bytes) -> bytes:
    fields = _unpack_fields(raw)
    return _json(fields.pop("v"), fields)


_cached_json = functools.lru_cache(maxsize=4096)(_binary_as_json)


def decode(raw: bytes | str) -> Plan:
    if isinstance(raw, str):
        raw = raw.encode()
    if is_json(raw):
        return decode_object(codec.loads(raw))
    return decode_object(_unpack_fields(raw))


def decode_object(data: dict[str, Any]) -> Plan:
    """Decode an already parsed compact value (the deliveries carry it inline)."""
    retry = data.get("r")
    misfire = data.get("f")
    return Plan(
        version=data["v"],
        rule=_decode_rule(data),
        target=_decode_target(data),
        start_ms=data.get("a"),
        end_ms=data.get("e"),
        max_fires=data.get("n"),
        jitter_ms=data.get("j", 0),
        retry=RetryRule(retry[0], retry[1], retry[2], retry[3], bool(retry[4]))
        if retry
        else _DEFAULT_RETRY,
        misfire=MisfireRule(_POLICY_NAMES[misfire[0]], misfire[1], misfire[2], misfire[3])
        if misfire
        else _DEFAULT_MISFIRE,
        exclude=_decode_exclusions(data),
        pause_after_failures=data.get("P"),
    )
