"""What apply, pause, resume, delete, trigger and backfill print for people (issue 36, newcomer
3): one line from the reply, naming the schedule and what happened; nothing for a refusal."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cronbus.cli import said
from cronbus.cli.main import build_parser

NEXT = "2026-11-28T18:00:00Z"


def schedule(state: str = "active", version: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "id": "nightly",
        "namespace": "default",
        "version": version,
        "state": state,
        "fires": 0,
        "next_fires": [NEXT] if state == "active" else [],
        **extra,
    }


@pytest.mark.parametrize(
    ("verb", "reply", "expected"),
    [
        (
            "upsert",
            {"ok": True, "created": True, "schedule": schedule(version=1)},
            f"schedule default/nightly created (version 1, next fire {NEXT})",
        ),
        (
            "upsert",
            {"ok": True, "created": False, "schedule": schedule()},
            f"schedule default/nightly updated (version 3, next fire {NEXT})",
        ),
        (
            "upsert",
            {"ok": True, "created": False, "unchanged": True, "schedule": schedule()},
            f"schedule default/nightly unchanged (version 3, next fire {NEXT})",
        ),
        (
            "upsert",
            {"ok": True, "created": True, "schedule": schedule("paused", 1)},
            "schedule default/nightly created (version 1, paused)",
        ),
        (
            "pause",
            {"ok": True, "schedule": schedule("paused", 4)},
            "paused default/nightly (version 4, paused)",
        ),
        (
            "pause",
            {"ok": True, "unchanged": True, "schedule": schedule("paused")},
            "default/nightly unchanged: already paused (version 3)",
        ),
        (
            "resume",
            {"ok": True, "schedule": schedule(version=5)},
            f"resumed default/nightly (version 5, next fire {NEXT})",
        ),
        ("delete", {"ok": True, "schedule": schedule("deleted", 6)}, "deleted default/nightly"),
        (
            "trigger",
            {
                "ok": True,
                "schedule": schedule(),
                "trigger": {"fire_time": "2026-11-28T17:50:01.250Z", "idempotency_key": "k-1"},
            },
            "triggered default/nightly: run 2026-11-28T17:50:01.250Z (idempotency key k-1)",
        ),
        (
            "backfill",
            {"ok": True, "backfill": {"occurrences": 7}},
            "backfill of default/nightly started: 7 occurrences to deliver, oldest first",
        ),
        (
            "backfill",
            {"ok": True, "backfill": {"occurrences": 0}},
            "backfill of default/nightly: no occurrence in the range, nothing to do",
        ),
    ],
)
def test_each_accepted_reply_is_one_line_saying_what_happened(
    verb: str, reply: dict[str, Any], expected: str
) -> None:
    assert said.line(verb, "default", reply, "nightly") == expected


def test_a_schedule_of_a_file_of_several_says_created_applied_or_unchanged() -> None:
    assert said.result_line("ns", {"id": "a", "ok": True, "version": 1}) == (
        "schedule ns/a created (version 1)"
    )
    assert said.result_line("ns", {"id": "a", "ok": True, "version": 4}) == (
        "schedule ns/a applied (version 4)"
    )
    assert said.result_line("ns", {"id": "a", "ok": True, "version": 4, "unchanged": True}) == (
        "schedule ns/a unchanged (version 4)"
    )
    assert said.result_line("ns", {"id": "a", "ok": False, "error": {"code": "x"}}) is None


REFUSAL = st.fixed_dictionaries(
    {
        "ok": st.just(False),
        "error": st.fixed_dictionaries({"code": st.text(), "message": st.text()}),
    }
)


@given(
    verb=st.sampled_from(["upsert", "pause", "resume", "delete", "trigger", "backfill"]),
    reply=REFUSAL,
)
def test_a_refusal_prints_nothing_on_stdout(verb: str, reply: dict[str, Any]) -> None:
    # Its one line (code, field, reason) goes to stderr, as before.
    assert said.line(verb, "ns", reply, "x") is None


IDS = st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=20)


@given(
    verb=st.sampled_from(["pause", "resume", "delete"]),
    schedule_id=IDS,
    state=st.sampled_from(["active", "paused", "completed", "deleted"]),
    version=st.integers(1, 10**6),
    unchanged=st.booleans(),
)
def test_a_line_names_the_schedule_and_is_one_line(
    verb: str, schedule_id: str, state: str, version: int, unchanged: bool
) -> None:
    reply = {
        "ok": True,
        "unchanged": unchanged,
        "schedule": schedule(state, version, id=schedule_id),
    }
    text = said.line(verb, "default", reply, schedule_id)
    assert text is not None and "\n" not in text
    assert f"default/{schedule_id}" in text


@pytest.mark.parametrize("verb", ["apply", "pause", "resume", "delete", "trigger", "backfill"])
def test_every_changing_verb_takes_o_and_defaults_to_text(verb: str) -> None:
    args = ["-f", "x.yaml"] if verb == "apply" else ["x"]
    if verb == "backfill":
        args += ["--from", "2027-01-01T00:00:00Z", "--to", "2027-01-02T00:00:00Z"]
    parser = build_parser()
    assert parser.parse_args([verb, *args]).output == "text"
    assert parser.parse_args([verb, *args, "-o", "json"]).output == "json"
    assert parser.parse_args([verb, *args, "-o", "yaml"]).output == "yaml"


def test_the_help_of_a_verb_names_its_formats() -> None:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["trigger", "--help"])
    assert "{text,json,yaml}" in out.getvalue()
