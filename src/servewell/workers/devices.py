"""Which device each instance of a model runs on: decided by the engine's pool, applied by the worker.

The frontend never imports a framework, so it counts the GPUs the way the driver shows them
(`/proc/driver/nvidia/gpus`, one entry per GPU, narrowed by `CUDA_VISIBLE_DEVICES` as CUDA
narrows it) and spreads `device: cuda` instances over them round-robin. Unverified on a GPU
machine in this project's CI; AMD (ROCm) GPUs are not counted this way: name them (`cuda:N`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: Where the NVIDIA driver lists the GPUs of this machine (or container), one directory each.
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


def choose_device(configured: str, instance: int, gpu_count: int) -> str:
    """The device instance `instance` is started on: `device: cuda` spreads instances over the
    `gpu_count` visible GPUs (instance i on `cuda:{i mod count}`); `cpu` and an explicit `cuda:N`
    are kept, and so is `cuda` when no GPU is visible (the runtime reports the missing GPU)."""
    if configured != "cuda" or gpu_count <= 0:
        return configured
    return f"cuda:{instance % gpu_count}"


def visible_gpu_count(gpus_dir: Path = NVIDIA_GPUS_DIR, env: Mapping[str, str] | None = None) -> int:
    """GPUs a worker would see: those the driver lists, narrowed by `CUDA_VISIBLE_DEVICES` of
    `env` (default: this process's environment, which the workers inherit). CUDA stops reading
    that list at the first entry that is not a device, so this does too; "" or "-1" hides every GPU."""
    try:
        physical = sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        return 0
    listed = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return physical
    count = 0
    for entry in (e.strip() for e in listed.split(",")):
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < physical):
            count += 1
        else:
            break
    return min(count, physical)
