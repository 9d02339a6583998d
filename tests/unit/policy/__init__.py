"""Unit tests of shared/policy: no I/O."""
