"""Preflight: estimate a model's memory from file headers before loading, keep a budget, and
measure what a loaded model really holds.

Read without importing a framework: the safetensors header is JSON behind an 8-byte length;
ONNX and TorchScript files are dominated by their weights, so their size is the estimate. A
runtime's descriptor (config/runtimes.py) gives its worker's resident cost before weights
(`base_bytes`) and may name its own estimate of the weights (`weight_bytes`).

An estimate is a guess (a python model's own imports and allocations are unknown until it loads:
issue 45 H16 saw 1,929 MB of server processes under a 500 MiB budget), so once a model has warmed
up, the budget counts what its workers hold, measured as their proportional set size (Pss of
/proc/<pid>/smaps_rollup: private pages whole, pages shared with other processes split between
them, so the figures of all processes add up to the memory they use together), whenever that is
more than the estimate: `max(estimate, measured)`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.runtimes import resolve

_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}
_FLOAT = {"F64", "F32", "F16", "BF16"}
_SERVING_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "auto": 4}  # auto may stay fp32: plan for it
#: Activations and allocator slack on top of the weights.
WORKING_SET_FACTOR = 1.25

MiB = 1 << 20


@dataclass(slots=True, frozen=True)
class MemoryEstimate:
    """Bytes one model needs, and how the number was reached."""

    weight_bytes: int
    per_instance_bytes: int
    total_bytes: int
    basis: str
    device_bytes: int = 0  # on the GPU, all instances together (0 for a CPU model)


def estimate_model_memory(config: ModelConfig, model_dir: Path) -> MemoryEstimate:
    """Estimate the resident memory of all instances of a model before loading it (a pipeline: none)."""
    if config.kind == "pipeline":
        return MemoryEstimate(0, 0, 0, "a pipeline runs in the engine")
    runtime = config.runtime_descriptor
    estimate: Callable[[ModelConfig, Path], tuple[int, str]] = (
        resolve(runtime.weight_bytes) if runtime.weight_bytes else artifact_weight_bytes)
    weights, basis = estimate(config, model_dir)
    base = runtime.base_bytes  # the worker's interpreter, framework and arenas, before any weights
    per_instance = int(weights * WORKING_SET_FACTOR) + base
    device = 0
    if config.device.startswith("cuda"):
        per_instance = base  # weights live on the device, not in host memory
        device = int(weights * WORKING_SET_FACTOR) * config.instances
    return MemoryEstimate(weights, per_instance, per_instance * config.instances, basis, device)


def artifact_weight_bytes(config: ModelConfig, model_dir: Path) -> tuple[int, str]:
    """The weights of a model from its artifact, and how they were estimated: a safetensors file's
    tensors at the serving dtype (from its header), else the file's size (halved for a torch
    runtime serving in fp16 or bf16); what a runtime's descriptor names no `weight_bytes` of its
    own uses."""
    path = model_dir / config.artifact
    dtype = config.torch_settings.dtype if config.torch_settings is not None else "fp32"  # onnx: as exported
    if path.suffix == ".safetensors":
        return _safetensors_bytes(path, dtype), f"safetensors header, {dtype}"
    weights = path.stat().st_size
    if dtype in ("fp16", "bf16"):
        weights //= 2
    return weights, f"file size of {path.name}"


def _safetensors_bytes(path: Path, dtype: str) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * MiB:
            raise ValueError(f"{path}: safetensors header of {length} bytes is implausible")
        header = json.loads(f.read(length))
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in info["shape"]:
            count *= dim
        kind = info["dtype"]
        itemsize = _SERVING_ITEMSIZE[dtype] if kind in _FLOAT else _SAFETENSORS_ITEMSIZE.get(kind, 4)
        total += count * itemsize
    return total


def machine_memory_budget(fraction: float = 0.9, meminfo: Path = Path("/proc/meminfo"),
                          cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Default budget: a share of the memory available when the server starts. In a container the
    host's free memory is not what the server may use: under a cgroup memory limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`) the budget is the share of what that limit leaves."""
    available: int | None = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = _cgroup_room(cgroup)
    if limit is not None:
        available = limit if available is None else min(available, limit)
    return int(available * fraction) if available is not None else 8 << 30


def _cgroup_room(root: Path) -> int | None:
    """Bytes this process's cgroup may still use (limit minus usage), or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_file).read_text().strip()
        except OSError:
            continue
        if not raw.isdigit() or int(raw) >= 1 << 60:  # "max", or v1's "no limit" (a huge number)
            return None
        try:
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            usage = 0
        return max(0, int(raw) - usage)
    return None


class MemoryBudget:
    """Host (and device) memory promised to loaded models; a load that would not fit is refused
    up front, or (lazy mode) makes room by evicting idle models first (engine/model_pool.py).

    A model counts its estimate until its measured host memory is known (`measure`), then the
    larger of the two (`held_bytes`)."""

    def __init__(self, total_bytes: int, device_total_bytes: int | None = None) -> None:
        self.total_bytes = total_bytes
        self.device_total_bytes = device_total_bytes  # None: the device is not limited by the server
        self._reserved: dict[Hashable, MemoryEstimate] = {}
        self._measured: dict[Hashable, int] = {}  # host bytes the owner's workers were measured to hold

    @property
    def used_bytes(self) -> int:
        """Host bytes the budget counts for models now (each: its estimate, or its measurement if more)."""
        return sum(self._charge(owner, e) for owner, e in self._reserved.items())

    @property
    def estimated_bytes(self) -> int:
        """Host bytes the models that hold a reservation were estimated to need."""
        return sum(e.total_bytes for e in self._reserved.values())

    @property
    def measured_bytes(self) -> int:
        """Host bytes measured of the models that hold a reservation (those measured so far)."""
        return sum(self._measured.get(owner, 0) for owner in self._reserved)

    def _charge(self, owner: Hashable, estimate: MemoryEstimate) -> int:
        return max(estimate.total_bytes, self._measured.get(owner, 0))

    def held_bytes(self, owner: object) -> int | None:
        """Host bytes the budget counts for `owner` now (None: it holds nothing)."""
        if not isinstance(owner, Hashable):
            return None
        held = self._reserved.get(owner)
        return None if held is None else self._charge(owner, held)

    def measured_by(self, owner: object) -> int | None:
        """`owner`'s last measured host bytes (None: not measured)."""
        return self._measured.get(owner) if isinstance(owner, Hashable) else None

    def measure(self, owner: Hashable, measured_bytes: int) -> None:
        """Record what `owner`'s workers hold (after warm-up, and again from time to time); from now
        on it counts `max(estimate, measured)`. Given before `owner` reserves (a reload of a model
        measured before), its reservation is checked against it too."""
        self._measured[owner] = measured_bytes

    def beyond_whole_budget(self, estimate: MemoryEstimate, label: str, measured_bytes: int = 0) -> str | None:
        """Why `estimate` (or the measurement, when more) could never fit, even with no other model
        loaded: it alone is more than the whole host or device budget. None: it could fit."""
        host = max(estimate.total_bytes, measured_bytes)
        if host > self.total_bytes:
            measured = measured_bytes > estimate.total_bytes
            basis = (f"was measured at {host / MiB:.0f} MiB after its last warm-up" if measured
                     else f"needs an estimated {host / MiB:.0f} MiB ({estimate.weight_bytes / MiB:.0f} MiB of weights "
                     f"from the {estimate.basis}, {estimate.per_instance_bytes / MiB:.0f} MiB per instance)")
            return (f"{label} {basis}, more than the whole {self.total_bytes / MiB:.0f} MiB memory budget: it can "
                    "never load here; raise --memory-budget-bytes, or lower its instances or dtype")
        device_total = self.device_total_bytes
        if device_total is not None and estimate.device_bytes > device_total:
            return (f"{label} needs an estimated {estimate.device_bytes / MiB:.0f} MiB of device memory, more than the "
                    f"whole {device_total / MiB:.0f} MiB device memory budget: it can never load here; raise "
                    "--device-memory-budget-bytes, or lower its instances or dtype")
        return None

    @property
    def device_used_bytes(self) -> int:
        """Device bytes promised to models now."""
        return sum(e.device_bytes for e in self._reserved.values())

    def reserved_by(self, owner: object) -> MemoryEstimate | None:
        """What `owner` holds now (None: nothing)."""
        return self._reserved.get(owner) if isinstance(owner, Hashable) else None

    def shortfall(self, owner: Hashable, estimate: MemoryEstimate) -> tuple[int, int]:
        """(host, device) bytes missing for `estimate` to fit besides what others hold; (0, 0) when it fits."""
        held = self._reserved.get(owner)
        host_others = self.used_bytes - (self._charge(owner, held) if held else 0)
        device_others = self.device_used_bytes - (held.device_bytes if held else 0)
        own = max(estimate.total_bytes, self._measured.get(owner, 0))
        host = max(0, host_others + own - self.total_bytes)
        device = 0
        if self.device_total_bytes is not None:
            device = max(0, device_others + estimate.device_bytes - self.device_total_bytes)
        return host, device

    def reserve(self, owner: Hashable, estimate: MemoryEstimate, label: str, hint: str = "") -> None:
        """Promise `estimate` to `owner` (a loaded model version; `label` names it in the error);
        `MemoryError` (with the numbers, and `hint` on what else holds memory) when it does not fit."""
        host, device = self.shortfall(owner, estimate)
        never = self.beyond_whole_budget(estimate, label, self._measured.get(owner, 0)) if host or device else None
        if never is not None:
            raise MemoryError(never)  # no eviction nor wait can help: say so, not "only N MiB left"
        if host:
            held = self._reserved.get(owner)
            others = self.used_bytes - (self._charge(owner, held) if held else 0)
            measured = self._measured.get(owner, 0)
            needs = (f"was measured at {measured / MiB:.0f} MiB after its last warm-up"
                     if measured > estimate.total_bytes else
                     f"needs an estimated {estimate.total_bytes / MiB:.0f} MiB "
                     f"({estimate.weight_bytes / MiB:.0f} MiB of weights from the {estimate.basis}, "
                     f"{estimate.per_instance_bytes / MiB:.0f} MiB per instance)")
            raise MemoryError(
                f"{label} {needs} but only "
                f"{max(0, self.total_bytes - others) / MiB:.0f} MiB of the {self.total_bytes / MiB:.0f} MiB "
                f"memory budget is left{hint}; raise --memory-budget-bytes, lower instances or dtype, or unload a model"
            )
        if device:
            assert self.device_total_bytes is not None
            raise MemoryError(
                f"{label} needs an estimated {estimate.device_bytes / MiB:.0f} MiB of device memory but only "
                f"{max(0, estimate.device_bytes - device) / MiB:.0f} MiB of the {self.device_total_bytes / MiB:.0f} "
                f"MiB device memory budget is left{hint}; raise --device-memory-budget-bytes or unload a model"
            )
        self._reserved[owner] = estimate

    def release(self, owner: Hashable) -> None:
        """Return `owner`'s share (and forget its measurement)."""
        self._reserved.pop(owner, None)
        self._measured.pop(owner, None)


def listed_estimate(budget: MemoryBudget, name: str, directory: Path,
                    config: ModelConfig | None) -> tuple[int | None, str | None]:
    """A listed model's estimated host bytes (None: unknown), and why it could never load when its
    estimate alone is more than the whole budget (None: it could): a lazy engine lists such a model
    as invalid, with the numbers (issue 45 W3: it was loadable and refused at each request as if an
    eviction could help, with a Retry-After); an eager one fails its load with the same words."""
    if config is None:
        return None, None
    try:
        estimate = estimate_model_memory(config, directory)
    except (OSError, ValueError):
        return None, None
    return estimate.total_bytes, budget.beyond_whole_budget(estimate, f"model '{name}' version '{config.version}'")


def proportional_set_bytes(pid: int) -> int | None:
    """A process's proportional set size (`Pss` of /proc/<pid>/smaps_rollup: its private pages and
    its share of the pages it shares, /dev/shm segments included); None when it cannot be read (the
    process is gone). About 1 ms for a process of a few hundred MB: read off the event loop."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def measure_processes(pids: tuple[int, ...]) -> int | None:
    """What the processes `pids` (one model's workers) hold together; None when any cannot be read:
    a partial figure would undercount the model."""
    total = 0
    for pid in pids:
        figure = proportional_set_bytes(pid)
        if figure is None:
            return None
        total += figure
    return total
