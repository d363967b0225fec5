"""Entry point for `python -m server.ray` (see server.ray.cli)."""

import sys

from server.ray.cli import main

sys.exit(main())
