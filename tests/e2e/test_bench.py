"""``cronbus bench`` as a user runs it: honest about its import, and CPU by component."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import standardwebhooks

from cronbus.bench import cpu as benchcpu
from cronbus.bench.herd import BENCH_SIGNING_SECRET
from cronbus.cli.sink import Sink
from tests.support import services

ROOT = Path(__file__).resolve().parents[2]


async def bench(endpoints: services.Endpoints, *args: str) -> tuple[int, str, str]:
    """Run ``cronbus bench ARGS`` in a process of its own (this loop keeps serving a sink)."""
    env = {
        **os.environ,
        "CRONBUS_REDIS_URL": endpoints.redis_url,
        "CRONBUS_AMQP_URL": endpoints.amqp_url,
        "CRONBUS_DATABASE_URL": endpoints.database_url,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cronbus.cli",
        "bench",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 100)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, out.decode(), err.decode()


# The first fire is due (and measuring starts) two seconds before the import even starts:
# any import overlaps, however fast.
OVERLAPPING = ("steady", "--schedules", "2000", "--rate", "1000", "--lead-s", "-2")
QUICK = (
    *("--warmup-s", "0", "--duration", "1", "--settle-s", "0.5"),
    *("--timeout-s", "5", "--executors", "1"),
)


async def test_steady_refuses_a_run_whose_import_ran_into_the_measured_window(
    endpoints: services.Endpoints,
) -> None:
    code, out, err = await bench(endpoints, *OVERLAPPING, *QUICK, "--json")
    assert code == 2, (out, err)
    assert "into the measured window" in err and "--lead-s" in err
    assert out == ""  # no figures to be mistaken for a measurement


async def test_allow_overlap_reports_the_run_flagged(endpoints: services.Endpoints) -> None:
    code, out, err = await bench(endpoints, *OVERLAPPING, *QUICK, "--allow-overlap", "--json")
    assert code == 0, err
    figures = json.loads(out)
    assert figures["flagged"] == "the import overlapped the measured window"
    assert figures["import_overlap_s"] > 0
    assert figures["import_margin_s"] < 0


async def test_herd_with_an_external_sink_counts_each_component(
    endpoints: services.Endpoints,
) -> None:
    sink = Sink()
    await sink.start()
    try:
        n = 2000
        code, out, err = await bench(
            endpoints,
            *("herd", "--n", str(n), "--sink-url", sink.url, "--lead-s", "3"),
            *("--settle-s", "0.5", "--executors", "1", "--json"),
        )
    finally:
        await sink.stop()
    assert code == 0, err
    figures = json.loads(out)
    # The figures read back from the execution rows agree with what the sink received.
    assert len({(r.schedule, r.fire_time) for r in sink.received}) == n
    assert figures["lost"] == 0
    assert figures["duplicates"] is None  # not visible from the rows
    assert figures["sink"] == f"external {sink.url}"
    by_component = figures["cpu_ms_per_fire_by_component"]
    assert set(by_component) == set(benchcpu.COMPONENTS)
    # Found by PID: the executor delivered, PostgreSQL wrote the rows, this process (the
    # external sink) answered 2000 requests.
    assert by_component["executors"] > 0
    assert by_component["postgresql"] > 0
    assert by_component["sink"] > 0
    assert figures["cpu_ms_per_fire"] >= by_component["executors"]
    assert figures["host_cpu_ms_per_fire"] > 0


async def test_rebuild_restores_everything_while_the_first_rebuilt_keep_firing(
    endpoints: services.Endpoints,
) -> None:
    n, firing = 20_000, 20
    code, out, err = await bench(
        endpoints,
        *("rebuild", "--n", str(n), "--firing", str(firing), "--executors", "1"),
        # Pages of 2 rows: a rebuild of some seconds, long enough to see fires inside it.
        *("--rebuild-batch", "2"),
        *("--settle-s", "1", "--json"),
    )
    assert code == 0, err
    figures = json.loads(out)
    assert figures["restored"] == n + firing
    # The firing schedules fired, every second of the rebuild, each of their fires once or
    # more, and were measured (lateness figures are the bench's to report, not to assert).
    assert figures["firing_expected"] >= firing, figures
    assert figures["firing_lost"] == 0, figures
    assert figures["firing_p99_ms"] >= 0


async def test_herd_with_features_signs_every_delivery_and_loses_none(
    endpoints: services.Endpoints,
) -> None:
    sink = Sink()
    await sink.start()
    try:
        n = 300
        code, out, err = await bench(
            endpoints,
            *("herd", "--n", str(n), "--features", "--sink-url", sink.url, "--lead-s", "3"),
            *("--settle-s", "0.5", "--executors", "1", "--json"),
        )
    finally:
        await sink.stop()
    assert code == 0, err
    assert json.loads(out)["lost"] == 0
    # The rate limit and the quota held nothing back; every delivery was signed, as the
    # Standard Webhooks package checks it.
    assert len({(r.schedule, r.fire_time) for r in sink.received}) == n
    verifier = standardwebhooks.Webhook(BENCH_SIGNING_SECRET)
    for received in sink.received:
        verifier.verify(received.body, received.headers, json_parse=False)
