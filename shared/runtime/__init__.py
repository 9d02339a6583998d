"""A service's runtime: settings, run loop, health, metrics, logs, outages, shutdown (I/O)."""
