"""``python -m services.executor``."""

# Before the imports below (they take a while): SIGTERM from now on is a clean stop.
from shared.runtime import stopsignal

stopsignal.catch()

import sys  # noqa: E402

from services.executor.service import ExecutorService  # noqa: E402
from shared.policy import signing  # noqa: E402
from shared.runtime import service, spans  # noqa: E402
from shared.runtime.config import ExecutorSettings  # noqa: E402

if __name__ == "__main__":
    settings = service.load_settings("executor", ExecutorSettings)
    try:
        executor = ExecutorService(settings)
    except (signing.SecretsError, spans.TracingUnavailable, OSError) as exc:
        print(f"cronbus executor: configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    service.main("executor", executor, settings)
