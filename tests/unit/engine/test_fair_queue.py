"""Weighted fair shares between tenants inside a lane (engine/batch_queue.py, issue 22): with one
tenant the queue is the earliest-deadline-first heap it was; with several, rows go to tenants in
proportion to their weights, a heavy tenant waits behind itself, and share left unused while idle
is banked only up to `BURST_BATCHES` batches."""

from __future__ import annotations

from collections import Counter

from servewell.engine.batch_queue import BURST_BATCHES, BatchQueue, QueuedItem


def item(tenant: str, deadline: float, rows: int = 1, shape: str = "s", lane: int = 0) -> QueuedItem[str]:
    return QueuedItem(f"{tenant}@{deadline:g}", lane, rows, shape, deadline, 0.0, tenant=tenant)


def drain(queue: BatchQueue[str], max_rows: int) -> list[list[str]]:
    batches = []
    while len(queue):
        batches.append([i.payload for i in queue.take_batch(max_rows)])
    return batches


def test_one_tenant_is_earliest_deadline_first() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 100)
    for deadline in (5, 1, 4, 2, 3):
        assert queue.push(item("", deadline)).admitted
    assert drain(queue, 2) == [["@1", "@2"], ["@3", "@4"], ["@5"]]


def test_a_heavy_tenant_waits_behind_itself() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 1000)
    for i in range(40):  # the heavy tenant's burst arrived first, with the earlier deadlines
        queue.push(item("heavy", i))
    for i in range(4):
        queue.push(item("light", 100 + i))
    first_two = drain(queue, 4)[:2]
    assert Counter(p.split("@")[0] for batch in first_two for p in batch) == {"heavy": 4, "light": 4}
    assert queue.tenant_depth("light") == 0


def test_shares_follow_the_weights() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    queue: BatchQueue[str] = BatchQueue(1, 10_000, weight_of=weights.__getitem__)
    for tenant in weights:
        for i in range(1000):
            queue.push(item(tenant, i))
    taken: Counter[str] = Counter()
    for _ in range(70):  # 560 rows, while every tenant still has work queued
        taken.update(i.tenant for i in queue.take_batch(8))
    assert taken == {"a": 80, "b": 160, "c": 320}


def test_a_tenant_the_lane_never_served_starts_level_with_the_clock() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 1000)
    for i in range(100):
        queue.push(item("early", i))
    for _ in range(10):
        queue.take_batch(8)  # 'early' alone: 80 rows, its virtual time is 80
    for i in range(40):
        queue.push(item("late", 1000 + i))  # new: starts level with 'early', not 80 rows behind, no credit
    taken = Counter(i.tenant for i in queue.take_batch(8) + queue.take_batch(8))
    assert taken == {"early": 8, "late": 8}


def test_rows_a_tenant_got_alone_are_not_held_against_it() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 1000)
    for i in range(50):
        queue.push(item("light", i))
    drain(queue, 4)  # light alone: 50 rows, then idle
    for i in range(100):
        queue.push(item("heavy", 100 + i))
    queue.push(item("light", 500))  # light again, behind a heavy backlog
    first_two = [i.tenant for i in queue.take_batch(4) + queue.take_batch(4)]
    assert "light" in first_two, first_two  # not after heavy's next 50 rows


def test_a_returning_tenant_spends_at_most_its_banked_batches_ahead_of_a_flood() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 10_000)
    queue.push(item("light", 0))
    queue.push(item("heavy", 1))
    drain(queue, 4)  # both served once: the lane knows them
    for i in range(400):
        queue.push(item("heavy", 10 + i))
    for _ in range(50):
        queue.take_batch(4)  # 200 rows of heavy while light is idle: far more share unused than the bound
    for i in range(40):
        queue.push(item("light", 1000 + i))  # a burst, after heavy's queued requests by deadline
    tenants = [i.tenant for _ in range(BURST_BATCHES + 2) for i in queue.take_batch(4)]
    banked, after = tenants[:4 * BURST_BATCHES], tenants[4 * BURST_BATCHES:]
    assert BURST_BATCHES >= 2 and banked == ["light"] * 4 * BURST_BATCHES  # whole batches, not one row in two
    assert Counter(after) == {"light": 4, "heavy": 4}  # then its share, level with the flood


def test_a_tenant_that_idles_between_bursts_gets_no_more_than_its_share() -> None:
    # A tenant whose every burst is served whole goes idle after each: returning at once, it has
    # left no share unused, so it banks nothing and a flood keeps its half.
    queue: BatchQueue[str] = BatchQueue(1, 10_000)
    for i in range(2000):
        queue.push(item("heavy", 10_000 + i))
    taken: Counter[str] = Counter()
    for burst in range(100):
        for i in range(4):
            queue.push(item("bursty", burst * 4 + i))
        while queue.tenant_depth("bursty"):
            taken.update(i.tenant for i in queue.take_batch(4))
    assert taken["bursty"] == 400
    assert taken["heavy"] >= 400 - 4 * BURST_BATCHES  # its half, less at most one banked bound


def test_weights_apply_to_whole_rows_and_batches_keep_one_shape() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 100)
    queue.push(item("a", 1, rows=3))
    queue.push(item("b", 2, rows=3, shape="other"))
    queue.push(item("b", 3, rows=2))
    queue.push(item("a", 4, rows=2))
    first = queue.take_batch(8)
    assert [i.payload for i in first] == ["a@1", "b@3", "a@4"]  # b's other-shape item waits for its own batch
    assert [i.payload for i in queue.take_batch(8)] == ["b@2"]


def test_cancel_and_expiry_keep_every_tenants_count() -> None:
    queue: BatchQueue[str] = BatchQueue(2, 100)
    items = [item("a", 1), item("a", 5), item("b", 2), item("b", 6, lane=1)]
    for i in items:
        queue.push(i)
    queue.cancel(items[1])
    assert queue.tenant_depth("a") == 1 and queue.tenant_depth("b") == 2 and len(queue) == 3
    assert [i.payload for i in queue.expire(3.0)] == ["a@1", "b@2"]
    assert queue.tenant_depth("a") == 0 and queue.tenant_depth("b") == 1
    assert queue.next_deadline() == 6
    assert [i.payload for i in queue.take_batch(8)] == ["b@6"]
    assert len(queue) == 0 and queue.head() is None


# --- fair admission: a full lane's places are shared by weight too (issue 46) ---------------------


def test_a_full_lane_pushes_out_the_flooders_newest_for_a_tenant_within_its_share() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 10)
    for i in range(9):
        assert queue.push(item("flood", i)).admitted
    assert queue.push(item("light", 50)).admitted  # the lane is now full: 9 + 1
    admission = queue.push(item("light", 51))
    assert admission.admitted
    assert admission.displaced is not None and admission.displaced.payload == "flood@8"  # its newest
    assert queue.places(0) == {"flood": 8, "light": 2}
    assert len(queue) == 10


def test_the_tenant_beyond_its_share_is_refused_itself_and_displaces_nobody() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 10)
    for i in range(6):
        queue.push(item("flood", i))
    for i in range(4):
        queue.push(item("light", 100 + i))
    refused = queue.push(item("flood", 99))
    assert not refused.admitted and refused.holder == "flood" and refused.displaced is None
    assert not queue.would_admit(0, "flood")
    assert queue.would_admit(0, "light")  # within its half: it would push out flood's newest
    assert queue.places(0) == {"flood": 6, "light": 4}


def test_places_promised_to_requests_on_their_way_in_fill_the_lane_for_its_holder_only() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 10)
    for i in range(7):
        queue.push(item("flood", i))
    assert queue.would_admit(0, "flood", promised=2)  # 7 queued + 2 on their way: one place left
    assert not queue.would_admit(0, "flood", promised=3)  # all ten spoken for: flood holds the most
    assert queue.would_admit(0, "light", promised=3)  # within its share: it would push out flood's newest


def test_a_light_tenant_keeps_its_requests_while_another_floods_a_full_lane() -> None:
    """A flood 10x the lane's size never costs the light tenant a queued request."""
    queue: BatchQueue[str] = BatchQueue(1, 20)
    refused: Counter[str] = Counter()
    pushed_out: Counter[str] = Counter()
    for round_ in range(10):
        for i in range(20):
            admission = queue.push(item("flood", round_ * 100 + i))
            if not admission.admitted:
                refused["flood"] += 1
        admission = queue.push(item("light", round_ * 100 + 50))
        if not admission.admitted:
            refused["light"] += 1
        if admission.displaced is not None:
            pushed_out[admission.displaced.tenant] += 1
        queue.take_batch(2)  # the model takes a little
    assert refused["light"] == 0 and pushed_out["light"] == 0
    assert refused["flood"] > 100


def test_places_in_a_full_lane_follow_the_weights() -> None:
    weights = {"gold": 3.0, "bronze": 1.0}
    queue: BatchQueue[str] = BatchQueue(1, 8, weight_of=lambda t: weights.get(t, 1.0))
    for i in range(6):
        queue.push(item("gold", i))
    for i in range(2):
        queue.push(item("bronze", 10 + i))
    # gold holds 6 of its 6 (3/4 of 8), bronze 2 of its 2: whoever comes next is the one beyond.
    assert not queue.push(item("bronze", 20)).admitted
    assert not queue.push(item("gold", 21)).admitted


def test_one_tenant_alone_is_refused_at_the_bound_as_before() -> None:
    queue: BatchQueue[str] = BatchQueue(1, 3)
    for i in range(3):
        assert queue.push(item("", i)).admitted
    admission = queue.push(item("", 9))
    assert not admission.admitted and admission.displaced is None
