"""``python -m services.console``."""

from services.console.service import ConsoleService
from shared import service
from shared.config import ConsoleSettings

if __name__ == "__main__":
    settings = service.load_settings("console", ConsoleSettings)
    service.main("console", ConsoleService(settings), settings)
