"""Unit tests of services/sweeper: no I/O."""
