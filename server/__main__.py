"""Entry point for `python -m server` (see server.cli)."""

import sys

from server.cli import main

sys.exit(main())
