"""GPU facts through NVML (nvidia-ml-py); an empty list, quietly, on machines without a GPU."""

from __future__ import annotations

import logging

log = logging.getLogger("servewell.observability")


class GpuProbe:
    """Reads utilization, memory, power and temperature of every GPU at scrape time."""

    def __init__(self) -> None:
        self._nvml = None
        self._unavailable = False

    def _init(self) -> bool:
        if self._nvml is not None:
            return True
        if self._unavailable:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver, no library, no device: absent, not an error
            self._unavailable = True
            return False
        self._nvml = pynvml
        return True

    def read(self) -> list[dict[str, float]]:
        """One dict per GPU; [] without NVML."""
        if not self._init():
            return []
        nvml = self._nvml
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
