"""GPU facts through NVML (nvidia-ml-py, the `servewell[gpu]` extra); an empty list, quietly, on
machines without a GPU."""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger("servewell.observability")


class GpuProbe:
    """Reads utilization, memory, power and temperature of every GPU at scrape time."""

    def __init__(self) -> None:
        self._nvml: ModuleType | None = None
        self._unavailable = False

    def _init(self) -> ModuleType | None:
        """pynvml, initialised; None where NVML cannot be used (remembered)."""
        if self._nvml is not None or self._unavailable:
            return self._nvml
        try:
            import pynvml
        except ImportError:
            self._unavailable = True
            if os.path.exists("/proc/driver/nvidia"):  # an NVIDIA driver is loaded: say what is missing
                log.info("GPU metrics need nvidia-ml-py: pip install 'servewell[gpu]'")
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # no driver, no device: absent, not an error
            self._unavailable = True
            return None
        self._nvml = pynvml
        return self._nvml

    def read(self) -> list[dict[str, float]]:
        """One dict per GPU; [] without NVML."""
        nvml = self._init()
        if nvml is None:
            return []
        gpus: list[dict[str, float]] = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpu: dict[str, float] = {"index": float(index)}
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpu["memory_used_bytes"] = float(memory.used)
                gpu["memory_total_bytes"] = float(memory.total)
                gpu["utilization_ratio"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                try:
                    gpu["power_watts"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                    gpu["temperature_celsius"] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
                except nvml.NVMLError:
                    pass  # not every board reports power or temperature
                gpus.append(gpu)
        except nvml.NVMLError as exc:
            log.warning("reading GPU metrics failed: %s", exc)
        return gpus
