"""Optional OpenTelemetry export of an occurrence's journey: claim -> publish -> deliver -> settle.

Off unless ``CRONBUS_OTLP_ENDPOINT`` is set (and the ``otel`` extra installed): the services
then hold ``None`` instead of a ``Spans`` and the hot path pays one ``is not None``. When on,
each stage of each attempt becomes a span in the occurrence's trace, with the ids of
``shared.policy.tracing`` (trace = idempotency key, span = (key, attempt, stage)), so the dispatcher
and the executor link their spans without passing anything, and the receiver's spans (under
the delivery's ``traceparent``) nest under "deliver". A retry's claim follows the previous
attempt's settle. Spans are exported in batches from a background thread (OTLP over HTTP);
when the collector is slow, the bounded queue drops spans, never deliveries.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from shared.policy import tracing

#: The stage each stage follows.
PARENT_STAGE = {"publish": "claim", "deliver": "publish", "settle": "deliver"}


class TracingUnavailable(RuntimeError):
    """CRONBUS_OTLP_ENDPOINT is set but the OpenTelemetry packages are not installed."""


def _context(key: str, attempt: int, stage: str) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags  # noqa: PLC0415 - optional

    return SpanContext(
        trace_id=int(tracing.trace_id(key), 16),
        span_id=int(tracing.span_id(key, attempt, stage), 16),
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )


class Spans:
    """Builds finished spans with cronbus's ids and hands them to a batching exporter."""

    def __init__(self, endpoint: str, service: str, exporter: Any = None) -> None:
        # Imported here: without the export on, none of OpenTelemetry is loaded.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

        exporter = exporter or OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        self._processor = BatchSpanProcessor(exporter, max_queue_size=8192)
        self._resource = Resource.create({"service.name": f"cronbus-{service}"})

    def record(
        self,
        stage: str,
        key: str,
        attempt: int,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, str | int | bool],
        error: str | None = None,
    ) -> None:
        from opentelemetry.sdk.trace import ReadableSpan  # noqa: PLC0415
        from opentelemetry.trace import SpanKind, Status, StatusCode  # noqa: PLC0415

        if stage in PARENT_STAGE:
            parent = _context(key, attempt, PARENT_STAGE[stage])
        else:  # a claim: the first attempt starts the trace, a retry follows the last settle
            parent = _context(key, attempt - 1, "settle") if attempt > 1 else None
        span = ReadableSpan(
            name=f"cronbus {stage}",
            context=_context(key, attempt, stage),
            parent=parent,
            resource=self._resource,
            attributes={"cronbus.attempt": attempt, "cronbus.idempotency_key": key, **attributes},
            kind=SpanKind.CLIENT if stage == "deliver" else SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
            start_time=start_ns,
            end_time=max(end_ns, start_ns),
        )
        self._processor.on_end(span)

    def shutdown(self) -> None:
        self._processor.shutdown()  # type: ignore[no-untyped-call]


def open_spans(endpoint: str, service: str) -> Spans | None:
    """``Spans`` when an endpoint is configured, else None (the export is off)."""
    if not endpoint:
        return None
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        raise TracingUnavailable(
            "CRONBUS_OTLP_ENDPOINT is set but OpenTelemetry is not installed: "
            "pip install 'cronbus[otel]'"
        )
    return Spans(endpoint, service)
