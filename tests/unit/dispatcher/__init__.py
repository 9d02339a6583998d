"""Unit tests of services/dispatcher: no I/O."""
