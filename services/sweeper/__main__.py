"""``python -m services.sweeper``."""

# Before the imports below (they take a while): SIGTERM from now on is a clean stop.
from shared.runtime import stopsignal

stopsignal.catch()

from services.sweeper.service import SweeperService  # noqa: E402
from shared.runtime import service  # noqa: E402
from shared.runtime.config import SweeperSettings  # noqa: E402

if __name__ == "__main__":
    settings = service.load_settings("sweeper", SweeperSettings)
    service.main("sweeper", SweeperService(settings), settings)
