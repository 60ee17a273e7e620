"""What each loaded model version really holds, measured after warm-up and from time to time
(issue 45 H16: the budget counted estimates only, and a python model's estimate knows nothing of
what its own code allocates).

A version's figure is the sum of its workers' proportional set sizes (engine/memory_budget.py,
`measure_processes`): read in a thread, about 1 ms per worker of a few hundred MB, only for
versions that are ready with every worker alive (a worker being replaced would undercount). The
budget then counts `max(estimate, measured)` for it, and the model's slot keeps the figure across
evictions: its next load of the same config is admitted by it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from servewell.engine.memory_budget import MemoryBudget, MiB, measure_processes
from servewell.engine.model_entry import ModelEntry
from servewell.engine.model_slot import ModelSlot

log = logging.getLogger("servewell.engine")

#: A loaded version and the slot it serves (None: a version of a traffic split beside the stable one).
Loaded = tuple[ModelSlot | None, ModelEntry]


def loaded_versions(slots: Iterable[ModelSlot]) -> list[Loaded]:
    """Every version that may hold memory: each model's current entry and its split's versions."""
    found: list[Loaded] = []
    for slot in list(slots):
        if isinstance(slot.entry, ModelEntry):
            found.append((slot, slot.entry))
        if slot.rollout is not None:
            found.extend((None, entry) for entry in slot.rollout.candidates.values())
    return found


class MemoryMeter:
    """Measures loaded versions and gives the figures to the budget (and their slots)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget

    async def measure(self, targets: list[Loaded]) -> None:
        """Measure the workers of each ready version of `targets` that holds a reservation."""
        asked: list[tuple[ModelSlot | None, ModelEntry, tuple[int, ...]]] = []
        for slot, entry in targets:
            instances = entry.instances()
            if entry.state != "ready" or self._budget.reserved_by(entry) is None or not instances:
                continue
            if all(i.alive and i.pid for i in instances):  # one being replaced: next time
                asked.append((slot, entry, tuple(i.pid for i in instances if i.pid)))
        if not asked:
            return
        figures = await asyncio.to_thread(lambda: [measure_processes(pids) for _, _, pids in asked])
        for (slot, entry, _), figure in zip(asked, figures, strict=True):
            # Checked again: the version may have stopped while its workers were read.
            if figure is None or entry.state != "ready" or self._budget.reserved_by(entry) is None:
                continue
            first = self._budget.measured_by(entry) is None
            self._budget.measure(entry, figure)
            if slot is not None and slot.entry is entry:
                slot.measured_bytes, slot.measured_config = figure, entry.config
            if first:
                held = self._budget.reserved_by(entry)
                estimated = held.total_bytes if held is not None else 0
                log.info("%s holds %.0f MiB after warm-up (estimated %.0f MiB); the budget counts %.0f MiB",
                         entry.label, figure / MiB, estimated / MiB, max(figure, estimated) / MiB,
                         extra={"event": "model_measured", "model": entry.name, "measured_bytes": figure,
                                "estimated_bytes": estimated})
