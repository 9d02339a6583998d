"""PostgreSQL, the source of truth: migrations, named queries, the store, bulk import (I/O)."""
