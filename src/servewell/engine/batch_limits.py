"""What one model's batches may be now, and how long one may take.

The live batching settings (an admin may change them while the model serves), the largest batch
proven to fit (the configured size, lowered by warm-up or an out-of-memory split; the live
`max_batch_size` never exceeds it), the warm-up latencies and the latency learned from the
batches run so far: together they say how large a batch may be, what one is expected to take
(`predicted_compute_s`: the admission chain's deadline check) and how long one may run before its
runner is declared hung (`compute_budget_s`). The scheduler (engine/scheduler.py) owns one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from servewell.config.model import BatchingConfig, ModelConfig
from servewell.engine.batch_policy import LearnedLoad
from servewell.engine.batch_settings import validated_update
from servewell.engine.batch_watch import compute_budget_s

log = logging.getLogger("servewell.engine")


class BatchLimits:
    """One model's live batching settings and what its batches have been measured to take."""

    def __init__(self, config: ModelConfig, learned: LearnedLoad) -> None:
        self._config = config
        self.batching: BatchingConfig = config.batching
        self._proven_max = max(1, config.max_batch_size)
        self.max_batch_size = self._proven_max  # live; never above the proven maximum
        self.learned = learned
        self._warmup_latency_s: dict[int, float] = {}  # batch size -> seconds, from the workers' warm-up

    @property
    def proven_max_batch_size(self) -> int:
        """The largest batch warm-up (or an out-of-memory split) proved fits."""
        return self._proven_max

    def limit_max_batch_size(self, size: int, why: str) -> None:
        """Lower the proven maximum (warm-up measured memory, or a batch ran out of device memory)."""
        if 1 <= size < self._proven_max:
            log.warning("model %s: %s; max_batch_size lowered from %d to %d", self._config.name, why,
                        self._proven_max, size, extra={"model": self._config.name})
            self._proven_max = size
            self.max_batch_size = min(self.max_batch_size, size)

    def observe_warmup(self, latency_by_batch: tuple[tuple[int, float], ...]) -> None:
        """Warm-up latencies of a worker (batch size, seconds): the basis of the compute budget.
        With several instances the slowest measurement counts."""
        for size, seconds in latency_by_batch:
            self._warmup_latency_s[size] = max(seconds, self._warmup_latency_s.get(size, 0.0))

    def compute_budget_s(self, rows: int) -> float:
        """How long a batch of `rows` may run before its runner is declared hung (`batch_watch`)."""
        latency = self.learned.latency
        return compute_budget_s(rows, self._warmup_latency_s, latency.predict(rows) if latency.observed else None,
                                self.batching.compute_timeout_ms)

    def predicted_compute_s(self, rows: int) -> float:
        """What a batch of `rows` is expected to take, from the batches measured so far (0 before any)."""
        latency = self.learned.latency
        return latency.predict(rows) if latency.observed else 0.0

    def apply(self, changes: Mapping[str, Any]) -> BatchingConfig:
        """Validate `changes` as a whole (all or nothing) and apply them; the settings now in force."""
        self.batching, self.max_batch_size = validated_update(self.batching, self.max_batch_size, self._proven_max,
                                                              self._config.instances, changes)
        return self.batching

    def settings(self) -> dict[str, Any]:
        """Current live settings."""
        return {"max_batch_size": self.max_batch_size, **self.batching.model_dump()}
