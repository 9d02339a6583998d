"""``python -m services.dispatcher``."""

from services.dispatcher.service import DispatcherService
from shared import service
from shared.config import DispatcherSettings

if __name__ == "__main__":
    settings = DispatcherSettings()
    service.main("dispatcher", DispatcherService(settings), settings)
