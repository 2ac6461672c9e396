"""``python -m dlcp``: the ``dlcp`` program without its installed script (a checkout, a test's subprocess)."""

import sys

from dlcp.cli import main

sys.exit(main())
