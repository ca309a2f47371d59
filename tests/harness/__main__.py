"""`python -m tests.harness ...`: the test host tool (tests/harness/cli.py)."""

import sys

from tests.harness.cli import main

sys.exit(main())
