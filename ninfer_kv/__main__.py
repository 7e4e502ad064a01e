"""``python -m ninfer_kv``: the same command line as ``ninfer-kv``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
