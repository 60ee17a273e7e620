"""What the autoscaler reads at each sync of a request-level run, gathered from the pods, and the
controller it feeds (`plan.autoscaler.HorizontalAutoscaler`).

- CPU, per ready pod: busy CPU-seconds (front busy + batch busy x threads; on a shared node the
  work actually done, so a pod slowed by sharing does not read busier) over the last
  max(sync_s, metric_window_s), divided by that span x the replica's cores. The span starts at the
  newest sync at or before its start (at the pod's readiness for a younger pod), so a window that
  is not a multiple of sync_s reads a little longer.
- QUEUE_DEPTH, per ready pod: its waiting requests (front queue + batcher lanes) at the sync; with
  metric_window_s > 0, the mean of the scrapes over that window plus the sync instant (a Prometheus
  `avg_over_time` of the gauge).
- QUEUE_WAIT, fleet-wide: the mean batcher-queue wait of the requests whose batch started within
  the last metric_window_s (60 s when 0), 0 when none did; the ready pods report 0 each (only their
  count matters to a `Value` target).
"""

from __future__ import annotations

from collections import deque

from servewell_plan.autoscaler import HorizontalAutoscaler
from servewell_plan.des_fleet import PodFleet
from servewell_plan.des_pod import Pod
from servewell_plan.model import AutoscalerSpec, ReplicaModel, ScalingSample, ScalingSignal

#: The queue-wait window when the spec's is 0 (the KEDA query's `rate(...[1m])`).
DEFAULT_WAIT_WINDOW_S = 60.0


class ScalingProbe:
    """The autoscaler of one run with what it reads from the pods."""

    __slots__ = (
        "_cores",
        "_cpu_window_s",
        "_wait_n",
        "_wait_sum",
        "_wait_window_s",
        "_waits",
        "depth_window_s",
        "hpa",
        "scrape_depths",
        "signal",
        "sync_s",
        "track_waits",
    )

    def __init__(self, spec: AutoscalerSpec, replica: ReplicaModel, initial_replicas: int) -> None:
        self.hpa = HorizontalAutoscaler(spec, initial_replicas)
        self.signal = spec.signal
        self.sync_s = spec.sync_s
        self._cores = replica.cores
        self._cpu_window_s = max(spec.sync_s, spec.metric_window_s)
        self.depth_window_s = spec.metric_window_s
        self._wait_window_s = spec.metric_window_s or DEFAULT_WAIT_WINDOW_S
        self.track_waits = spec.signal is ScalingSignal.QUEUE_WAIT
        self.scrape_depths = spec.signal is ScalingSignal.QUEUE_DEPTH and spec.metric_window_s > 0
        self._waits: deque[tuple[float, float, int]] = deque()  # (batch start, sum of waits, requests)
        self._wait_sum = 0.0
        self._wait_n = 0

    def record_batch(self, t: float, wait_sum_s: float, requests: int) -> None:
        """A batch started at `t` whose requests waited `wait_sum_s` in all in the batcher."""
        self._waits.append((t, wait_sum_s, requests))
        self._wait_sum += wait_sum_s
        self._wait_n += requests

    def sync(self, now: float, clock: tuple[float, float], fleet: PodFleet, current_replicas: int) -> int:
        """One sync at `now` (`clock`: the run's CPU clock then): the Deployment's new spec.replicas."""
        fleet_value: float | None = None
        if self.signal is ScalingSignal.CPU:
            values = tuple(self._cpu(pod, now, clock) for pod in fleet.ready)
        elif self.signal is ScalingSignal.QUEUE_DEPTH:
            values = tuple(self._depth(pod, now) for pod in fleet.ready)
        else:
            values = (0.0,) * len(fleet.ready)
            fleet_value = self._mean_wait(now)
        sample = ScalingSample(current_replicas, values, fleet.starting(), fleet_value)
        return self.hpa.sync(now, sample)

    def _cpu(self, pod: Pod, now: float, clock: tuple[float, float]) -> float:
        busy = pod.busy_cpu_s(clock)
        marks = pod.cpu_marks
        start = now - self._cpu_window_s
        while len(marks) > 1 and marks[1][0] <= start:
            marks.popleft()
        since_s, busy_then = marks[0] if marks else (now, busy)
        marks.append((now, busy))
        span = now - since_s
        return (busy - busy_then) / (span * self._cores) if span > 0 else 0.0

    def _depth(self, pod: Pod, now: float) -> float:
        instant = pod.waiting()
        if self.depth_window_s <= 0:
            return float(instant)
        samples = pod.depth_samples
        start = now - self.depth_window_s
        while samples and samples[0][0] < start:
            samples.popleft()
        return (sum(n for _, n in samples) + instant) / (len(samples) + 1)

    def _mean_wait(self, now: float) -> float:
        waits = self._waits
        start = now - self._wait_window_s
        while waits and waits[0][0] < start:
            _, wait_sum, n = waits.popleft()
            self._wait_sum -= wait_sum
            self._wait_n -= n
        if not waits:  # no drift of the running sums once the window is empty
            self._wait_sum, self._wait_n = 0.0, 0
        if self._wait_n <= 0:
            return 0.0
        return max(0.0, self._wait_sum) / self._wait_n
