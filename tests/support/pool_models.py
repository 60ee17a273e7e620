"""Python models for the model pool's tests (lazy mode, eviction, the memory budget): tiny files,
with settings that make what the pool must cope with real: memory held from `setup` on (ballast
whose pages are touched, so a worker really holds it) and a `teardown` that takes its time (the
eviction of such a model lasts as long).

x [2] -> y [2] = 2 * x. Every model's module is `pool_steps`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

POOL_STEPS = textwrap.dedent('''
    import time

    import numpy as np


    class Doubler:
        """y = 2 x after `execute_ms`; holds `ballast_mib` MiB from setup on; its teardown takes
        `teardown_ms`."""

        def setup(self, config):
            settings = config["settings"]
            self.execute_s = settings.get("execute_ms", 0) / 1000.0
            self.teardown_s = settings.get("teardown_ms", 0) / 1000.0
            # np.ones writes every page: the memory is resident, not merely reserved.
            self.ballast = np.ones(int(settings.get("ballast_mib", 0)) * (1 << 20) // 8)

        def execute(self, inputs):
            time.sleep(self.execute_s)
            return {"y": inputs["x"] * 2.0}

        def teardown(self):
            time.sleep(self.teardown_s)
''')


def pool_model(root: Path, name: str, *, ballast_mib: int = 0, teardown_ms: int = 0, execute_ms: int = 0,
               **fields: Any) -> Path:
    """Write the python model `name` under `root` (`fields` go to its model.yaml: a version of a
    traffic split is `pool_model(root / "m" / "versions", "2", version="2")`); its directory."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "pool_steps.py").write_text(POOL_STEPS)
    settings = {"ballast_mib": ballast_mib, "teardown_ms": teardown_ms, "execute_ms": execute_ms}
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "pool_steps.py",
        "python": {"entry": "pool_steps:Doubler", "settings": settings},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}], "max_batch_size": 4, **fields,
    }))
    return directory


def pool_body(value: float = 1.0) -> dict[str, Any]:
    """An OIP request of one row [value, value] for a pool model."""
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [value, value]}]}
