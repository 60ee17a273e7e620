"""Which modules a worker imports for a runtime, imported as one step so a load can time it.

A fresh worker imports them when its model asks; a spare worker (`workers/spare.py`) imports
`SPARE_RUNTIME`'s ahead of time, so that the model it is given later skips this step. The backend
module of each runtime is its descriptor's (config/runtimes.py).
"""

from __future__ import annotations

import importlib

from servewell.config.runtimes import RuntimeDescriptor

#: What every runtime's load and warm-up import besides its backend module.
COMMON_MODULES = ("servewell.runtimes.warmup",)
#: What a spare worker imports before it knows its model. onnxruntime only: on the 2-core dev
#: machine it takes 0.43 s and 62 MiB resident (numpy and servewell included). torch would save a
#: torch model 1.9 s more but costs 127 MiB more private memory per spare (2.2 s, 247 MiB in all),
#: and an ONNX model adopting such a spare would carry that memory against its
#: `host_memory_limit_bytes` and the memory budget: torch models import torch after adoption.
SPARE_RUNTIME = "onnx"
#: onnxruntime's switch for its telemetry (1.29 and later on Linux): set to 1 before the import, no
#: uploader thread, device id or offline event database is created. `servewell` sets it unless the
#: user has (cli.py).
ORT_TELEMETRY_SWITCH = "ORT_DISABLE_TELEMETRY"


def backend_modules(runtime: RuntimeDescriptor) -> tuple[str, ...]:
    """The servewell modules `runtime`'s load and warm-up import (and, through them, the framework);
    none for a runtime that has no worker."""
    return (runtime.backend, *COMMON_MODULES) if runtime.in_worker else ()


def import_backend(runtime: RuntimeDescriptor) -> None:
    """Import the modules `runtime` loads with. A missing package is left for `load_runtime` to
    report, with the package and the extra that installs it."""
    for module in backend_modules(runtime):
        try:
            importlib.import_module(module)
        except ImportError:
            return
