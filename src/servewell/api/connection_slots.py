"""Which connections the frontend keeps: a bounded number, a reserve for probes, and eviction of
the connections that cost least to drop.

Pure and synchronous (no sockets, no clock), so the policy is unit-tested on its own; the HTTP
protocol (`http_limits.py`) tells it what each connection is doing.

The policy, in order, for a connection that arrives:

1. a regular slot is free: take it;
2. all regular slots are taken, but some are *waiting* (no request yet, idle between requests,
   or still sending a request's head or body): evict the one that has waited longest, take its slot;
3. every regular connection is serving a request: take a reserve slot, which may only serve the
   probe paths (health, metrics), so probes are answered while the server is full;
4. every reserve slot is taken too: evict the longest-waiting reserve connection, or refuse.

Evicting waiting connections is what makes slowloris harmless: an attacker's connections are
older than a real client's, so new arrivals push them out, and a real client's request head
arrives within milliseconds, long before enough newer connections could queue behind it.
Closing an idle keep-alive connection is ordinary HTTP (nginx does the same when it runs out of
connections); a connection whose whole request has arrived is never evicted. One whose body is
still arriving is (with a 503): 1,100 bodies trickling one byte every 3 s once held every slot
for the whole body timeout, while a real client's body arrives in milliseconds.
"""

from __future__ import annotations

import enum
from typing import Protocol


class SlotKind(enum.Enum):
    """What a newly arrived connection was given."""

    REGULAR = "regular"
    RESERVE = "reserve"  # may serve the probe paths only
    REFUSED = "refused"


class Evictable(Protocol):
    """A connection the slots can close to make room."""

    def evict(self) -> None:
        """Close the connection now (it has no request in progress)."""


class _Pool:
    """One kind of slot: its members, and the waiting ones in the order they started waiting."""

    __slots__ = ("capacity", "evicted", "members", "waiting")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.members: set[Evictable] = set()
        # A dict keeps insertion order: its first key has waited longest.
        self.waiting: dict[Evictable, None] = {}
        self.evicted = 0

    def take(self, connection: Evictable) -> bool:
        """Add `connection` (waiting) if a slot is free, after evicting the longest waiter if needed."""
        if len(self.members) >= self.capacity:
            if not self.waiting:
                return False
            victim = next(iter(self.waiting))
            self.drop(victim)  # released before it is told, so its own release is a no-op
            self.evicted += 1
            victim.evict()
        self.members.add(connection)
        self.waiting[connection] = None
        return True

    def drop(self, connection: Evictable) -> None:
        self.members.discard(connection)
        self.waiting.pop(connection, None)


class ConnectionSlots:
    """Bounded connection slots: `regular` for everyone, `reserve` for probes when those are full."""

    def __init__(self, regular: int, reserve: int) -> None:
        if regular < 1 or reserve < 0:
            raise ValueError("need at least one regular slot and a non-negative reserve")
        self._regular = _Pool(regular)
        self._reserve = _Pool(reserve)
        #: Connections refused since start (every slot busy).
        self.refused = 0

    @property
    def evicted(self) -> int:
        """Waiting connections closed since start to make room."""
        return self._regular.evicted + self._reserve.evicted

    @property
    def open(self) -> int:
        """Connections holding a slot now."""
        return len(self._regular.members) + len(self._reserve.members)

    @property
    def reserve_in_use(self) -> int:
        """Connections holding a reserve slot now."""
        return len(self._reserve.members)

    def admit(self, connection: Evictable) -> SlotKind:
        """Give a newly arrived `connection` a slot (it starts out waiting), evicting if needed."""
        if self._regular.take(connection):
            return SlotKind.REGULAR
        if self._reserve.capacity and self._reserve.take(connection):
            return SlotKind.RESERVE
        self.refused += 1
        return SlotKind.REFUSED

    def waiting(self, connection: Evictable) -> None:
        """`connection` finished its request and waits for the next one: it may be evicted."""
        for pool in (self._regular, self._reserve):
            if connection in pool.members:
                pool.waiting.pop(connection, None)  # re-entering waits from now: to the back
                pool.waiting[connection] = None
                return

    def busy(self, connection: Evictable) -> None:
        """`connection` has sent a whole request (head and body): it is not evicted until it waits again."""
        self._regular.waiting.pop(connection, None)
        self._reserve.waiting.pop(connection, None)

    def release(self, connection: Evictable) -> None:
        """`connection` closed (idempotent; an evicted one is already released)."""
        self._regular.drop(connection)
        self._reserve.drop(connection)
