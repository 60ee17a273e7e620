"""The example images that ship in the package, as tests send them."""

from __future__ import annotations

import base64
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "src" / "servewell" / "examples" / "images"
#: A valid PNG of a digit, base64-encoded as /predict takes it.
GOOD_IMAGE = base64.b64encode(sorted(p for p in EXAMPLES.iterdir() if p.suffix == ".png")[0].read_bytes()).decode()
