"""`python -m servewell` is the `servewell` command."""

import sys

from servewell.cli import main

sys.exit(main())
