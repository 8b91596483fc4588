"""``python -m mxmoe``: the command line (also what torchrun launches)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
