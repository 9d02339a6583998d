"""What the index holds for each schedule, as values: occurrence states, claims, completions,
upserts and backfills (pure: the encodings ``shared.redis.index`` and the Lua scripts agree on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

UpsertMode = Literal["keep", "reset", "resume", "park"]


#: Occurrence flag: a catch-up the misfire policy chose; it is delivered, never judged again.
CATCH_UP_FLAG = "c"


def occ_state(
    nominal_ms: int, attempt: int = 1, token: int | str = "", fires: int = 0, flags: str = ""
) -> str:
    state = f"{nominal_ms}|{attempt}|{token}|{fires}"
    return f"{state}|{flags}" if flags else state


def resting_occ_state(
    nominal_ms: int, fire_ms: int, fires: int, counts_fires: bool, catch_up: bool = False
) -> str:
    """The occ value a not-yet-claimed occurrence needs, or "" when the defaults say it all.

    Most schedules rest with no occ entry at all (nominal = due score, attempt 1, no count),
    which keeps Redis memory per idle schedule small.
    """
    if nominal_ms == fire_ms and not counts_fires and not catch_up:
        return ""
    return occ_state(nominal_ms, 1, "", fires, CATCH_UP_FLAG if catch_up else "")


def split_tail(tail: str) -> tuple[int, bool]:
    """The ``fires[|flags]`` end of an occurrence state -> (fires, chosen as a catch-up)."""
    fires, _, flags = tail.partition("|")
    return int(fires), CATCH_UP_FLAG in flags


@dataclass(slots=True)
class Claimed:
    shard: int
    member: str
    fire_ms: int
    nominal_ms: int
    attempt: int
    token: int
    fires: int
    #: The compact schedule as stored (see ``shared.rules.compact``).
    plan: bytes
    #: A catch-up chosen by the misfire policy: delivered however late it is claimed.
    catch_up: bool = False


@dataclass(slots=True)
class ClaimResult:
    shard: int
    now_ms: int
    #: Earliest fire time still waiting in the shard, None when it is empty.
    next_due_ms: int | None
    orphans: int
    claimed: list[Claimed]
    #: Due entries whose stored state did not parse (left in place, a minute on).
    corrupt: int = 0
    #: Due entries put back a moment because another occurrence of their schedule (regular
    #: or backfill) is in flight.
    waiting: int = 0
    #: Nothing was claimed: the shard's position is behind a command already answered.
    fenced: bool = False


@dataclass(frozen=True, slots=True)
class Completion:
    member: str
    token: int
    next_fire_ms: int | None
    next_occ: str = ""
    #: The schedule is over (max_fires, end_at or a once): drop its stored copy.
    finish: bool = False


@dataclass(frozen=True, slots=True)
class BackfillStart:
    """backfill.lua's input: the schedule ``member`` (``ns/id``) and its backfill's state."""

    member: str
    generation: int
    to_ms: int
    #: Occurrences left to deliver (0: none; a running backfill is dropped).
    remaining: int
    #: Nominal time of the first of them (None when ``remaining`` is 0). Whether the schedule
    #: is paused, backfill.lua reads from the index itself.
    first_ms: int | None


@dataclass(frozen=True, slots=True)
class HeldBackfill:
    """A ``bf`` hash value: ``generation|to_ms|remaining|start|paused``."""

    generation: int
    to_ms: int
    remaining: int
    #: The first occurrence of a backfill waiting for an older one's in flight (None: started).
    start_ms: int | None
    paused: bool


def parse_backfill(value: str) -> HeldBackfill:
    generation, to_ms, remaining, start, paused = value.split("|")
    return HeldBackfill(
        int(generation), int(to_ms), int(remaining), int(start) if start else None, paused == "1"
    )


@dataclass(frozen=True, slots=True)
class Upsert:
    member: str
    version: int
    plan: bytes
    mode: UpsertMode
    next_fire_ms: int | None
    next_occ: str = ""
