"""``python -m services.dispatcher``."""

import sys

from services.dispatcher.service import DispatcherService
from shared import service, spans
from shared.config import DispatcherSettings

if __name__ == "__main__":
    settings = service.load_settings("dispatcher", DispatcherSettings)
    try:
        dispatcher = DispatcherService(settings)
    except spans.TracingUnavailable as exc:
        print(f"cronbus dispatcher: configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    service.main("dispatcher", dispatcher, settings)
