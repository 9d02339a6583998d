"""The ``cronbus`` command: publish commands, preview fire times, inspect schedules and
executions, run the services locally, benchmark (``cronbus.bench``)."""
