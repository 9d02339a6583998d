"""``python -m services.dispatcher``."""

from services.dispatcher.service import DispatcherService
from shared import service
from shared.config import DispatcherSettings

if __name__ == "__main__":
    settings = service.load_settings("dispatcher", DispatcherSettings)
    service.main("dispatcher", DispatcherService(settings), settings)
