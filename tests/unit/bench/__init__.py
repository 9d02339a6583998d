"""Unit tests of cronbus/bench (its pure parts): no I/O."""
