"""``python -m services.executor``."""

import sys

from services.executor.service import ExecutorService
from shared import service, signing, spans
from shared.config import ExecutorSettings

if __name__ == "__main__":
    settings = service.load_settings("executor", ExecutorSettings)
    try:
        executor = ExecutorService(settings)
    except (signing.SecretsError, spans.TracingUnavailable, OSError) as exc:
        print(f"cronbus executor: configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    service.main("executor", executor, settings)
