"""How much fuzzing a run does: a bounded number of examples in `make test`, many more in `make fuzz`.

`SERVEWELL_FUZZ=long` (set by `make fuzz`) selects the long profile; hypothesis keeps no example
database in the repository (failures print the reproducing example and `@reproduce_failure`).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("SERVEWELL_FUZZ") == "long"
#: Examples per hypothesis property: small enough that `make test` stays fast.
PROPERTY_EXAMPLES = 2000 if LONG else 150
#: Examples per API operation for schemathesis.
API_EXAMPLES = 300 if LONG else 10

settings.register_profile(
    "servewell", max_examples=PROPERTY_EXAMPLES, deadline=None, database=None, derandomize=not LONG,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("servewell")
