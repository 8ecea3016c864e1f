"""``python -m aioxfer`` runs the ``aioxfer`` command."""

import sys

from aioxfer.cli import main

if __name__ == "__main__":
    sys.exit(main())
