"""``python -m services.dispatcher``."""

# Before the imports below (they take a while): SIGTERM from now on is a clean stop.
from shared.runtime import stopsignal

stopsignal.catch()

import sys  # noqa: E402

from services.dispatcher.service import DispatcherService  # noqa: E402
from shared.runtime import service, spans  # noqa: E402
from shared.runtime.config import DispatcherSettings  # noqa: E402

if __name__ == "__main__":
    settings = service.load_settings("dispatcher", DispatcherSettings)
    try:
        dispatcher = DispatcherService(settings)
    except spans.TracingUnavailable as exc:
        print(f"cronbus dispatcher: configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    service.main("dispatcher", dispatcher, settings)
