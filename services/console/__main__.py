"""``python -m services.console``."""

# Before the imports below (they take a while): SIGTERM from now on is a clean stop.
from shared.runtime import stopsignal

stopsignal.catch()

from services.console.service import ConsoleService  # noqa: E402
from shared.runtime import service  # noqa: E402
from shared.runtime.config import ConsoleSettings  # noqa: E402

if __name__ == "__main__":
    settings = service.load_settings("console", ConsoleSettings)
    service.main("console", ConsoleService(settings), settings)
