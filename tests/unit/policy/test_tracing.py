"""W3C traceparent of deliveries (pure)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from shared.policy import tracing
from shared.rules import schedule

TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]\Z")


@given(
    st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=20),
    st.integers(0, 2**42),
    st.integers(1, 100),
)
def test_every_attempt_of_an_occurrence_is_one_trace(
    schedule_id: str, nominal_ms: int, attempt: int
) -> None:
    key = schedule.idempotency_key("acme", schedule_id, nominal_ms)
    header = tracing.traceparent(key, attempt)
    assert TRACEPARENT.match(header), header
    _, trace_id, span_id, flags = header.split("-")
    assert trace_id == key.replace("-", "") and trace_id != "0" * 32
    assert span_id != "0" * 16 and flags == "00"
    again = tracing.traceparent(key, attempt + 1, sampled=True)
    assert again.split("-")[1] == trace_id  # a retry stays in the trace
    assert again.split("-")[2] != span_id and again.endswith("-01")
    stages = {tracing.span_id(key, attempt, s) for s in ("claim", "publish", "deliver", "settle")}
    assert len(stages) == 4
