"""Unit tests of shared/contract: no I/O."""
