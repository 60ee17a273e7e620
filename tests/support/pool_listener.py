"""A `PoolListener` for worker-pool tests: records the workers reported ready and the pool's states."""

from __future__ import annotations

from servewell.workers.handle import WorkerHandle
from servewell.workers.pool import PoolState, RestartReason, WarmupFacts


class Listener:
    """Records what a pool reports (the `PoolListener` protocol)."""

    def __init__(self) -> None:
        self.ready: list[WorkerHandle] = []
        self.states: list[PoolState] = []

    def worker_ready(self, worker: WorkerHandle) -> None:
        self.ready.append(worker)

    def worker_gone(self, worker: WorkerHandle) -> None:
        pass

    def max_batch_size_limited(self, size: int, why: str) -> None:
        pass

    def warmed_up(self, facts: WarmupFacts) -> None:
        pass

    def worker_replaced(self, reason: RestartReason) -> None:
        pass

    def pool_state(self, state: PoolState, reason: str | None) -> None:
        self.states.append(state)
