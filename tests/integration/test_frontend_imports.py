"""The frontend never imports a framework: in a fresh interpreter, importing the composition root
(which pulls in the api, the engine and the workers' client side) loads no torch, onnxruntime,
onnx, scikit-learn or servewell runtime. A crash, leak or slow import of a framework stays in a
worker process; and a frontend-only install (no extras) can run."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("torch", "onnxruntime", "onnx", "sklearn", "safetensors")

PROBE = """
import json, sys
import servewell.cli, servewell.server
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_the_frontend_loads_no_framework_and_no_runtime():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(done.stdout)
    assert "servewell.engine.scheduler" in modules and "servewell.workers.handle" in modules  # the probe is real
    loaded = [m for m in modules if m.split(".")[0] in FRAMEWORKS or m.startswith("servewell.runtimes")]
    assert loaded == []
