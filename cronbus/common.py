"""What the ``cronbus`` subcommands share."""

from __future__ import annotations


class CliError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""
