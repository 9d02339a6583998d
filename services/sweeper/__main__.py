"""``python -m services.sweeper``."""

from services.sweeper.service import SweeperService
from shared import service
from shared.config import SweeperSettings

if __name__ == "__main__":
    settings = service.load_settings("sweeper", SweeperSettings)
    service.main("sweeper", SweeperService(settings), settings)
