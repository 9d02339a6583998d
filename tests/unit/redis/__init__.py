"""Unit tests of shared/redis (its pure parts): no I/O."""
