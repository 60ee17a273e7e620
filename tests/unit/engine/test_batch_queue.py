from servewell.engine.batch_queue import BatchQueue, QueuedItem

HIGH, NORMAL = 0, 1


def item(name, lane=NORMAL, deadline=100.0, rows=1, shape="a", at=0.0):
    return QueuedItem(name, lane, rows, shape, deadline, at)


def names(items):
    return [i.payload for i in items]


def test_high_lane_goes_first_then_earliest_deadline():
    q = BatchQueue(lanes=2, max_queue_size=10)
    q.push(item("n-late", deadline=50))
    q.push(item("n-early", deadline=10))
    q.push(item("h", lane=HIGH, deadline=90))
    assert names(q.take_batch(max_rows=1)) == ["h"]
    assert names(q.take_batch(max_rows=1)) == ["n-early"]
    assert names(q.take_batch(max_rows=1)) == ["n-late"]
    assert q.take_batch(max_rows=1) == []


def test_batch_fills_up_to_max_rows_in_deadline_order_and_lanes_never_mix():
    q = BatchQueue(lanes=2, max_queue_size=10)
    for i in range(5):
        q.push(item(f"n{i}", deadline=10 + i))
    q.push(item("h", lane=HIGH))
    assert names(q.take_batch(max_rows=3)) == ["h"]  # an urgent batch stays small
    assert names(q.take_batch(max_rows=3)) == ["n0", "n1", "n2"]
    assert len(q) == 2


def test_lower_lane_cannot_starve():
    q = BatchQueue(lanes=2, max_queue_size=100, max_consecutive_high=3)
    q.push(item("n"))
    for i in range(10):
        q.push(item(f"h{i}", lane=HIGH, deadline=i))
    taken = [names(q.take_batch(max_rows=1))[0] for _ in range(5)]
    assert taken == ["h0", "h1", "h2", "n", "h3"]


def test_only_same_shape_items_share_a_batch():
    q = BatchQueue(lanes=2, max_queue_size=10)
    q.push(item("a1", shape="a", deadline=1))
    q.push(item("b1", shape="b", deadline=2))
    q.push(item("a2", shape="a", deadline=3))
    assert names(q.take_batch(max_rows=8)) == ["a1", "a2"]
    assert names(q.take_batch(max_rows=8)) == ["b1"]


def test_multi_row_items_never_overflow_the_batch():
    q = BatchQueue(lanes=2, max_queue_size=10)
    q.push(item("three", rows=3, deadline=1))
    q.push(item("two", rows=2, deadline=2))
    q.push(item("one", rows=1, deadline=3))
    assert names(q.take_batch(max_rows=4)) == ["three", "one"]
    assert names(q.take_batch(max_rows=4)) == ["two"]


def test_lane_bound_refuses_beyond_max_queue_size_per_lane():
    q = BatchQueue(lanes=2, max_queue_size=2)
    assert q.push(item("n1")).admitted and q.push(item("n2")).admitted
    assert not q.push(item("n3")).admitted
    assert q.push(item("h1", lane=HIGH))  # the other lane has its own bound
    assert q.depth(NORMAL) == 2 and q.depth(HIGH) == 1


def test_expire_removes_only_items_past_their_deadline():
    q = BatchQueue(lanes=2, max_queue_size=10)
    q.push(item("soon", deadline=5))
    q.push(item("later", deadline=50))
    q.push(item("h-soon", lane=HIGH, deadline=4))
    assert q.next_deadline() == 4
    assert sorted(names(q.expire(now=5))) == ["h-soon", "soon"]
    assert names(q.take_batch(max_rows=8)) == ["later"]
    assert q.next_deadline() is None


def test_cancelled_items_are_never_handed_out_and_free_their_slot():
    q = BatchQueue(lanes=2, max_queue_size=1)
    gone = item("gone")
    q.push(gone)
    q.cancel(gone)
    assert len(q) == 0
    assert q.push(item("kept")).admitted
    assert names(q.take_batch(max_rows=8)) == ["kept"]


def test_cancel_after_take_does_not_corrupt_counts():
    q = BatchQueue(lanes=2, max_queue_size=10)
    taken = item("taken")
    q.push(taken)
    q.take_batch(max_rows=1)
    q.cancel(taken)
    assert len(q) == 0 and q.depth(NORMAL) == 0
