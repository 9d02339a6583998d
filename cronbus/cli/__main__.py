"""``python -m cronbus.cli``: the ``cronbus`` command."""

import sys

from cronbus.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
