"""The pods of a request-level run: their lifecycle transitions, the balancer's list of ready pods,
and the time integrals of the pod counts (what the run costs, what each bin shows).

Every change of a pod's state goes through one method here, so the ready list and the counts stay
consistent. New pods go to the zone with the fewest live pods among the zones not lost (ties: the
lowest zone), so the initial pods land in zone i % zones. After a ZONE_LOST the zone stays lost
for the rest of the run, unless every zone is lost (a one-zone fleet restarts in place).
"""

from __future__ import annotations

from servewell_plan.des_pod import DRAINING, GONE, READY, STARTING, Pod


class PodFleet:
    """The live pods (starting, ready, draining) and the integrals of their counts over the run.

    `ready` is the balancer's view, `ready_load[i]` the requests in flight at `ready[i]` (kept
    alongside so that least-connections is one `min` over a list). Integrals are kept per bin of
    `bin_s` up to `horizon_s`, the end of the run's load.
    """

    __slots__ = (
        "_instances",
        "_last_s",
        "_serial",
        "bin_s",
        "horizon_s",
        "live",
        "lost_zones",
        "paid_area",
        "ready",
        "ready_area",
        "ready_load",
        "zones",
    )

    def __init__(self, zones: int, instances: int, bin_s: float, horizon_s: float, bins: int) -> None:
        self.zones = max(1, zones)
        self._instances = instances
        self.bin_s = bin_s
        self.horizon_s = horizon_s
        self.lost_zones: set[int] = set()
        self.live: list[Pod] = []  # every pod not GONE, in creation order
        self.ready: list[Pod] = []
        self.ready_load: list[int] = []
        self._serial = 0
        self._last_s = 0.0
        self.ready_area = [0.0] * bins  # pod-seconds ready, per bin
        self.paid_area = [0.0] * bins  # pod-seconds starting, ready or draining, per bin

    # -- accounting ----------------------------------------------------------------------------

    def account(self, t: float) -> None:
        """Integrate the pod counts up to `t` (called before every change of them)."""
        t = min(t, self.horizon_s)
        last = self._last_s
        if t <= last:
            return
        ready, paid = len(self.ready), len(self.live)
        bin_s = self.bin_s
        while last < t:
            index = int(last // bin_s)
            edge = min((index + 1) * bin_s, t)
            if index < len(self.paid_area):
                self.ready_area[index] += ready * (edge - last)
                self.paid_area[index] += paid * (edge - last)
            last = edge
        self._last_s = t

    def starting(self) -> int:
        """Pods created and not ready yet."""
        return sum(1 for p in self.live if p.state == STARTING)

    # -- transitions ---------------------------------------------------------------------------

    def create(self, t: float, count: int, *, ready: bool = False) -> list[Pod]:
        """`count` new pods, STARTING (READY at once with `ready`), each in the least-filled zone."""
        self.account(t)
        allowed = [z for z in range(self.zones) if z not in self.lost_zones] or list(range(self.zones))
        per_zone = [0] * self.zones
        for pod in self.live:
            per_zone[pod.zone] += 1
        created = []
        for _ in range(count):
            zone = min(allowed, key=lambda z: (per_zone[z], z))
            per_zone[zone] += 1
            pod = Pod(self._serial, zone, self._instances)
            self._serial += 1
            self.live.append(pod)
            created.append(pod)
            if ready:
                self._enter_ready(pod, t)
        return created

    def make_ready(self, pod: Pod, t: float) -> None:
        """A STARTING pod passed its start delay (anything else: nothing happens)."""
        if pod.state == STARTING:
            self.account(t)
            self._enter_ready(pod, t)

    def remove(self, t: float, count: int) -> list[Pod]:
        """Scale down by `count`: the pods not ready yet first (newest first), then the newest ready
        ones, which leave the balancer at once and drain. Returns the pods that drain."""
        self.account(t)
        starting = sorted((p for p in self.live if p.state == STARTING), key=lambda p: -p.serial)
        ready = sorted(self.ready, key=lambda p: -p.serial)
        draining = []
        for pod in (starting + ready)[:count]:
            if pod.state == READY:
                self._leave_ready(pod)
                pod.state = DRAINING
                draining.append(pod)
                if pod.inflight == 0:
                    self._gone(pod)
            else:
                self._gone(pod)
        return draining

    def drained(self, pod: Pod, t: float) -> None:
        """A DRAINING pod answered its last request: it stops costing."""
        self.account(t)
        self._gone(pod)

    def kill(self, pod: Pod, t: float) -> bool:
        """`pod` dies. Returns whether it counted towards spec.replicas (the ReplicaSet replaces it)."""
        self.account(t)
        counted = pod.state == STARTING or pod.state == READY
        if pod.state == READY:
            self._leave_ready(pod)
        self._gone(pod)
        return counted

    def lose_zone(self, zone: int) -> list[Pod]:
        """Zone `zone` is gone: new pods avoid it. Returns its live pods (the caller kills them)."""
        self.lost_zones.add(zone)
        return [p for p in self.live if p.zone == zone]

    # -- internals -----------------------------------------------------------------------------

    def _enter_ready(self, pod: Pod, t: float) -> None:
        pod.state = READY
        pod.idle_since = t
        pod.pos = len(self.ready)
        self.ready.append(pod)
        self.ready_load.append(pod.inflight)
        pod.cpu_marks.append((t, 0.0))  # a pod does no work before it is ready

    def _leave_ready(self, pod: Pod) -> None:
        # Swap with the last: O(1), and the balancer's order does not matter beyond being fixed.
        pos, last = pod.pos, self.ready[-1]
        self.ready[pos] = last
        self.ready_load[pos] = self.ready_load[-1]
        last.pos = pos
        self.ready.pop()
        self.ready_load.pop()
        pod.pos = -1

    def _gone(self, pod: Pod) -> None:
        pod.state = GONE
        self.live.remove(pod)
