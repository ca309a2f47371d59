"""The GPU speed run: the Triton path against vLLM's own OpenAI server.

The check lives in lab.gpucheck.speed (its docstring says what it records and how to
run it); src/ must be importable (the device kit's gpu-setup.sh puts it on the path).
"""

import sys

from lab.gpucheck.speed import main

if __name__ == "__main__":
    sys.exit(main())
