"""Trace context: with CRONBUS_OTLP_ENDPOINT set, an occurrence's claim, publish, deliver and
settle arrive at an OpenTelemetry collector as one trace, and the webhook's traceparent names
the deliver span (so the receiver's own spans nest under it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from cronbus.cli.sink import Sink
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

Span = tuple[str, str, str, str, str]  # service, name, trace id, span id, parent span id


@pytest.fixture
async def collector() -> AsyncIterator[tuple[str, list[Span]]]:
    """A stand-in OpenTelemetry collector: OTLP over HTTP (protobuf) on loopback."""
    received: list[Span] = []

    async def traces(request: web.Request) -> web.Response:
        export = trace_service_pb2.ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        (
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                        )
                    )
        return web.Response(
            body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = services.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", received
    await runner.cleanup()


async def test_one_trace_per_occurrence_from_claim_to_settle(
    stack: Stack, sink: Sink, client: CommandClient, collector: tuple[str, list[Span]]
) -> None:
    endpoint, spans = collector
    await stack.start_all(
        ("dispatcher", "executor"), CRONBUS_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="200"
    )
    reply = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "traced",
                "spec": {"kind": "interval", "every_s": 1},
                "target": {"kind": "webhook", "url": f"{sink.url}/traced"},
            }
        },
    )
    assert reply["ok"], reply
    assert await sink.wait_for(lambda s: len(s.received) >= 1, timeout_s=10), stack.tails()
    first = sink.received[0]
    version, trace_id, deliver_id, flags = first.headers["traceparent"].split("-")
    assert (version, flags) == ("00", "01")  # exported: sampled
    assert trace_id == first.key.replace("-", "")

    def of_trace() -> dict[str, Span]:
        return {s[1]: s for s in spans if s[2] == trace_id}

    for _ in range(100):
        if len(of_trace()) == 4:
            break
        await asyncio.sleep(0.1)
    found = of_trace()
    assert set(found) == {"cronbus claim", "cronbus publish", "cronbus deliver", "cronbus settle"}
    claim, publish = found["cronbus claim"], found["cronbus publish"]
    deliver, settle = found["cronbus deliver"], found["cronbus settle"]
    assert claim[0] == publish[0] == "cronbus-dispatcher"
    assert deliver[0] == settle[0] == "cronbus-executor"
    assert claim[4] == ""  # the first attempt starts the trace
    assert publish[4] == claim[3] and deliver[4] == publish[3] and settle[4] == deliver[3]
    assert deliver[3] == deliver_id
