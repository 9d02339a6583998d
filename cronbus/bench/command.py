"""``cronbus bench``: its verbs, one per benchmark module, and the options several of them share.

Measures nothing itself. Each benchmark module adds its own verb with its own options
(``add_kind``); the options that the harness reads (``--sink-url``, ``--allow-overlap``, the
services' counts, ``--events``) and those every service benchmark takes (``--json``,
``--lead-s``, ``--settle-s``) are added here, after each verb's own, so ``--help`` lists them
last. This is the only module that imports the benchmarks.
"""

from __future__ import annotations

import argparse
import os

from cronbus.bench import console, drift, fairness, held, herd, intake, rebuild, steady


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="measure cronbus on this machine (herd, steady, held, ...)")
    kinds = p.add_subparsers(dest="bench", required=True, metavar="KIND")
    # ``cronbus bench --help`` lists the verbs in the order they are added.
    herd_kind = herd.add_kind(kinds)
    fairness_kind = fairness.add_kind(kinds)
    steady_kind = steady.add_kind(kinds)
    rebuild_kind = rebuild.add_kind(kinds)
    console.add_kind(kinds)
    intake_kind = intake.add_kind(kinds)
    drift_kind = drift.add_kind(kinds)
    held_kind = held.add_kind(kinds)
    for kind in (herd_kind, steady_kind):
        _add_sink_options(kind)
    _add_json(drift_kind)
    for kind in (herd_kind, fairness_kind, steady_kind, rebuild_kind, intake_kind, held_kind):
        _add_json(kind)
        _add_service_options(kind, dispatcher_counts=kind is intake_kind)


def _add_json(kind: argparse.ArgumentParser) -> None:
    kind.add_argument("--json", action="store_true", help="one JSON line of figures")


def _add_sink_options(kind: argparse.ArgumentParser) -> None:
    """For the benchmarks whose figures are CPU per fire: where the sink's CPU goes matters."""
    kind.add_argument(
        "--sink-url",
        help="deliver to this sink (http, loopback, e.g. an nginx answering 200) instead "
        "of the bench's in-process one, so the sink's CPU is not the bench's",
    )
    kind.add_argument(
        "--allow-overlap",
        action="store_true",
        help="report a run whose import ran into the measured window, flagged, "
        "instead of refusing it",
    )


def _add_service_options(kind: argparse.ArgumentParser, dispatcher_counts: bool = False) -> None:
    """For the benchmarks that start the services (``cronbus.bench.harness``). With
    ``dispatcher_counts``, ``--dispatchers`` takes several counts, each measured in turn."""
    kind.add_argument(
        "--executors",
        type=int,
        default=os.cpu_count() or 1,
        help="executor processes (default: one per core)",
    )
    if dispatcher_counts:
        kind.add_argument(
            "--dispatchers",
            type=int,
            nargs="+",
            default=[1, 2, 4],
            help="dispatcher processes: each count measured in turn, in a corner of its own "
            "(default 1 2 4)",
        )
    else:
        kind.add_argument("--dispatchers", type=int, default=1)
    kind.add_argument(
        "--events",
        default="failures",
        choices=("all", "failures", "none"),
        help="CRONBUS_EVENTS for the run (default failures)",
    )
    kind.add_argument(
        "--lead-s",
        type=float,
        default=None,
        help="seconds between the start of the import and the first fire",
    )
    kind.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="seconds to wait for late duplicates after the last delivery",
    )
