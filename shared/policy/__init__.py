"""Per-target and per-tenant policies: rate limits, breakers, fairness, the network policy,
signing, stats, tracing ids.

Pure: nothing here does I/O.
"""
