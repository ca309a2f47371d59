"""The repeatable GPU check under KIND_GPU and KIND_MODEL.

The check lives in lab.gpucheck.check (its docstring says what it records and how to
run it); src/ must be importable (the device kit's gpu-setup.sh puts it on the path).
"""

import sys

from lab.gpucheck.check import main

if __name__ == "__main__":
    sys.exit(main())
