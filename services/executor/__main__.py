"""``python -m services.executor``."""

from services.executor.service import ExecutorService
from shared import service
from shared.config import ExecutorSettings

if __name__ == "__main__":
    settings = service.load_settings("executor", ExecutorSettings)
    service.main("executor", ExecutorService(settings), settings)
