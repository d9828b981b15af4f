"""`python -m planner BRIEF.yaml [--json] [--simulate]`."""

import sys

from planner.cli import main

sys.exit(main(sys.argv[1:]))
