"""Places in a lane promised to requests that were admitted at their head but are not queued yet.

A request is admitted before its body is read (`ServedModel.admit`), then read and decoded, and
only then queued. Decoding an image takes 5-30 ms, so under overload several admitted requests
are on their way at any moment: a lane with one free place admitted every arrival until the first
of them was queued, and the engine refused the rest after their bodies had been read and decoded
(`make bench`'s 3x overload of ResNet-50: refusals at p50 1.5 ms, but 3-5 % of them after 20-60 ms,
which made the p99). Counting the places promised to requests still on their way, as well as the
places queued, a lane is full for a newcomer as soon as its last place is spoken for.

A `Promise` is held by the request's call while it is read and decoded, and dropped when its
request is built (`InferenceCall.request_for`) or the call ends any other way: the count is of
live promises (a weak set), so a call that fails half-way can never leave a place promised.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable


class Promise:
    """One promised place; it counts while something holds it."""

    __slots__ = ("__weakref__",)


class PromisedPlaces:
    """Live promises by lane (any hashable key: a lane index, or (model, lane) in an ingress)."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[Hashable, weakref.WeakSet[Promise]] = {}

    def promise(self, key: Hashable) -> Promise:
        """A new promise of a place in `key`'s lane, counted until it is dropped."""
        promises = self._by_key.get(key)
        if promises is None:
            promises = self._by_key[key] = weakref.WeakSet()
        promise = Promise()
        promises.add(promise)
        return promise

    def count(self, key: Hashable) -> int:
        """Promises of `key`'s lane still held."""
        promises = self._by_key.get(key)
        return len(promises) if promises is not None else 0
