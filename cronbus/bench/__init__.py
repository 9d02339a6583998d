"""``cronbus bench``: the real services (or the console, or the sweeper's code), measured.

One module per benchmark (``herd``, ``fairness``, ``steady``, ``rebuild``, ``intake``,
``drift``, ``console``), each saying what it measures and how; what the service benchmarks
share in ``harness`` (a corner of their own, the services, the sink, the seeding, CPU per
component); the CPU arithmetic and PID reading in ``cpu``; the verbs and their options in
``command``, the only module that imports the benchmarks. This package imports none of them,
so that importing one benchmark does not import the others.
"""
