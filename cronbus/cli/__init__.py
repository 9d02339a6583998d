"""The ``cronbus`` command: publish commands, preview fire times, inspect schedules and
executions, run the services locally, benchmark (``cronbus.bench``)."""

from cronbus.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
