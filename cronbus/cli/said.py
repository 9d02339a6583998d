"""What ``apply``, ``pause``, ``resume``, ``delete``, ``trigger`` and ``backfill`` print for
people (no I/O): one short line per accepted command, from its reply.

``-o json`` prints the reply itself instead (the line these verbs printed before), for scripts;
a refusal prints nothing here (its one line goes to stderr, whatever the format).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What these verbs may print: ``text`` (the default, for people), or the reply.
FORMATS = ("text", "json", "yaml")

#: The word for what a change did, by verb.
_DONE = {"pause": "paused", "resume": "resumed", "delete": "deleted"}


def _name(namespace: str, schedule: Mapping[str, Any], fallback: str | None) -> str:
    return f"{schedule.get('namespace') or namespace}/{schedule.get('id') or fallback or '?'}"


def _where_it_stands(schedule: Mapping[str, Any]) -> str:
    """``next fire T`` for an active schedule; otherwise its state (nothing will fire)."""
    state = schedule.get("state")
    if state == "active":
        upcoming = schedule.get("next_fires") or []
        return f"next fire {upcoming[0]}" if upcoming else "no further fire"
    if state == "paused" and schedule.get("paused_reason") == "failures":
        return "paused after failures"
    return str(state or "state unknown")


def _upserted(namespace: str, reply: Mapping[str, Any]) -> str:
    schedule = reply.get("schedule") or {}
    if reply.get("unchanged"):
        done = "unchanged"
    elif reply.get("created"):
        done = "created"
    else:
        done = "updated"
    return (
        f"schedule {_name(namespace, schedule, None)} {done} "
        f"(version {schedule.get('version')}, {_where_it_stands(schedule)})"
    )


def _changed(verb: str, namespace: str, reply: Mapping[str, Any], schedule_id: str) -> str:
    schedule = reply.get("schedule") or {}
    name = _name(namespace, schedule, schedule_id)
    if verb == "delete":
        return f"deleted {name}"
    if reply.get("unchanged"):
        # Already where the command asked: a completed schedule neither pauses nor resumes.
        return (
            f"{name} unchanged: already {schedule.get('state')} (version {schedule.get('version')})"
        )
    return f"{_DONE[verb]} {name} (version {schedule.get('version')}, {_where_it_stands(schedule)})"


def _triggered(namespace: str, reply: Mapping[str, Any], schedule_id: str) -> str:
    run = reply.get("trigger") or {}
    name = _name(namespace, reply.get("schedule") or {}, schedule_id)
    return (
        f"triggered {name}: run {run.get('fire_time')} "
        f"(idempotency key {run.get('idempotency_key')})"
    )


def _backfilled(namespace: str, reply: Mapping[str, Any], schedule_id: str) -> str:
    count = (reply.get("backfill") or {}).get("occurrences", 0)
    if not count:
        return f"backfill of {namespace}/{schedule_id}: no occurrence in the range, nothing to do"
    noun = "occurrence" if count == 1 else "occurrences"
    return f"backfill of {namespace}/{schedule_id} started: {count} {noun} to deliver, oldest first"


def line(verb: str, namespace: str, reply: Mapping[str, Any], schedule_id: str = "") -> str | None:
    """The line for an accepted reply of ``verb``; None for a refusal (said on stderr) or a
    verb this module does not know (the caller prints the reply as it came)."""
    if not reply.get("ok"):
        return None
    if verb == "upsert" and "schedule" in reply:
        return _upserted(namespace, reply)
    if verb in _DONE and "schedule" in reply:
        return _changed(verb, namespace, reply, schedule_id)
    if verb == "trigger" and "trigger" in reply:
        return _triggered(namespace, reply, schedule_id)
    if verb == "backfill" and "backfill" in reply:
        return _backfilled(namespace, reply, schedule_id)
    return None


def result_line(namespace: str, result: Mapping[str, Any]) -> str | None:
    """One accepted schedule of a file of several; None for a refused one. An ``upsert_many``
    result carries no ``created``: version 1 is a new schedule, a later one ``applied`` (it
    may be an update, or a schedule created again after a delete)."""
    if not result.get("ok"):
        return None
    version = result.get("version")
    if result.get("unchanged"):
        done = "unchanged"
    elif version == 1:
        done = "created"
    else:
        done = "applied"
    return f"schedule {namespace}/{result.get('id')} {done} (version {version})"
