"""``python -m engine.worker``: the worker's command line (``engine.worker.cli``)."""

import sys

from engine.worker.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m engine.worker"))
