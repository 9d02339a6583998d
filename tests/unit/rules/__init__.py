"""Unit tests of shared/rules: no I/O."""
