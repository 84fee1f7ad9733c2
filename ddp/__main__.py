"""``python -m ddp COMMAND``: see ``ddp.cli``."""

import sys

from ddp.cli import main

if __name__ == "__main__":
    sys.exit(main())
