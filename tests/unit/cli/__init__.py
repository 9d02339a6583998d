"""Unit tests of the cronbus command: no I/O."""
