"""Which priority lane a request goes to: the one rule every protocol uses.

A model's lanes are listed highest first (default `["high", "normal"]`; a model may rename them
or add more). Clients name a lane in two vocabularies:

- urgency (`X-Urgency` header, `/predict`'s `urgency` field): `high` is the first lane, `normal`
  the default lane, `low` the last lane; a lane's own name also works;
- OIP `parameters.priority`, as Triton defines it: 0 (or absent) is the default lane, 1 the
  highest, 2 the next, ... up to the number of lanes (a larger number is refused, naming the range,
  so that a client never believes it got a lane the model does not have); a lane's name also works.

When both are given, urgency wins: it is what a gateway or the caller's header says about this
very request. The default lane is `normal` when the model has one, else its last lane.
"""

from __future__ import annotations

from collections.abc import Sequence

from servewell.errors import InvalidInput, quote

URGENCIES = ("high", "normal", "low")


def default_lane(lanes: Sequence[str]) -> int:
    """Index of the lane a request that names none goes to."""
    return lanes.index("normal") if "normal" in lanes else len(lanes) - 1


def resolve_lane(lanes: Sequence[str], urgency: str | None = None, priority: object = None) -> int:
    """Index into `lanes` for a request's urgency and/or OIP priority (`InvalidInput` if unknown)."""
    if urgency is not None and urgency != "":
        return _from_urgency(lanes, urgency)
    if priority is None:
        return default_lane(lanes)
    return _from_priority(lanes, priority)


def _from_urgency(lanes: Sequence[str], urgency: str) -> int:
    if urgency in lanes:
        return lanes.index(urgency)
    value = urgency.strip().lower()
    if value == "high":
        return 0
    if value == "normal":
        return default_lane(lanes)
    if value == "low":
        return len(lanes) - 1
    raise InvalidInput(f"urgency {quote(urgency)} is not one of {list(URGENCIES)} or a lane of this model "
                       f"{list(lanes)}")


def _from_priority(lanes: Sequence[str], priority: object) -> int:
    if isinstance(priority, str) and priority in lanes:
        return lanes.index(priority)
    if isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= len(lanes):
        return default_lane(lanes) if priority == 0 else priority - 1
    raise InvalidInput(f"parameters.priority must be an integer 0..{len(lanes)} (0: default, 1: highest) "
                       f"or one of {list(lanes)}, got {quote(priority)}")
