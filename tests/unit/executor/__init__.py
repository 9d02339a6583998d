"""Unit tests of services/executor: no I/O."""
