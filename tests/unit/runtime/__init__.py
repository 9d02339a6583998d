"""Unit tests of shared/runtime (its pure parts): no I/O."""
