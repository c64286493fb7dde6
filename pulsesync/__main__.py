"""`python -m pulsesync` runs the CLI."""

import sys

from pulsesync.cli import main

sys.exit(main())
