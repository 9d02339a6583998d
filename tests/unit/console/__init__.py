"""Unit tests of services/console: no I/O."""
