"""The Redis index: the Lua script registry, typed batched script calls, call coalescing (I/O)."""
