"""The engine lifecycle and input checks on a real GPU host: start, bounds, admin APIs,
an engine killed mid-stream, stop.

The check lives in lab.gpucheck.lifecycle (its docstring says what it records and how to
run it); src/ must be importable (the device kit's gpu-setup.sh puts it on the path).
"""

import sys

from lab.gpucheck.lifecycle import main

if __name__ == "__main__":
    sys.exit(main())
