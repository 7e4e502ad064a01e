"""``python -m ninfer_kv.cli``: the same command line as ``ninfer-kv``."""

import sys

from .app import main

if __name__ == "__main__":
    sys.exit(main())
