"""The tuner's search, ladders and recommendation, driven by a fake measurement function."""

from __future__ import annotations

import pytest

from servewell.perf.tune_report import recommendation_text, results_json
from servewell.perf.tune_state import TuneState
from servewell.perf.tuner import (
    Candidate,
    Climb,
    LadderPoint,
    Measurement,
    Search,
    build_space,
    ladder_start,
    recommend,
    server_shapes,
)

SLO_MS = 50.0
BASELINE = Candidate(max_batch_size=64, policy="idle", max_wait_ms=25.0, instances=1, threads=1)


def fake_point(candidate: Candidate, concurrency: int, noise: float = 1.0) -> LadderPoint:
    """A made-up machine: batching helps up to 8 rows, two threads help, windows cost latency.

    Capacity saturates at `peak`; p99 grows with the queue of clients beyond what one batch
    round serves, plus the window wait.
    """
    rows = min(candidate.max_batch_size, 8, concurrency)
    peak = 100.0 * rows ** 0.5 * (1.6 if candidate.threads == 2 else 1.0) * (1.3 if candidate.instances == 2 else 1.0)
    throughput = min(peak, 100.0 * concurrency) * noise
    p99 = 5.0 + 1000.0 * concurrency / peak + candidate.max_wait_ms * (candidate.policy == "window")
    return LadderPoint(concurrency, round(throughput, 1), p99 / 2, p99 * 0.8, round(p99, 2), 0)


def measure_run(candidate: Candidate, previous: Measurement | None, max_concurrency: int = 128,
                noise: float = 1.0) -> list[LadderPoint]:
    climb = Climb(SLO_MS, ladder_start(candidate, previous, SLO_MS), max_concurrency)
    while (level := climb.next_level()) is not None:
        climb.record(fake_point(candidate, level, noise))
    return climb.points


def run_search(space, results=None, limit=200, stop_after=None):
    """Drive the search to its end (or `stop_after` measurements); returns results and the order."""
    search = Search(space)
    results = {} if results is None else results
    order = []
    while (step := search.next(results)) is not None and len(order) < limit:
        if stop_after is not None and len(order) == stop_after:
            break
        phase, candidate = step
        previous = results.get(candidate.key)
        runs = previous.runs if previous else []
        noise = 0.97 if runs else 1.0  # a repeat measures a little lower: the spread is visible
        measurement = previous or Measurement(candidate)
        measurement.runs.append(measure_run(candidate, previous, noise=noise))
        results[candidate.key] = measurement
        order.append((phase, candidate.key))
    return results, order


def test_a_climb_doubles_until_the_slo_breaks():
    points = measure_run(Candidate(8, "idle", 0, 1, 1), None)
    levels = [p.concurrency for p in points]
    assert levels[0] == 8 and levels == sorted(levels)
    assert points[-1].p99_ms > SLO_MS or len(points) > 1
    assert all(p.within(SLO_MS) for p in points[:-1])


def test_a_climb_that_starts_above_the_slo_halves_until_one_holds():
    candidate = Candidate(64, "idle", 0, 1, 1)
    points = measure_run(candidate, None)
    assert [p.concurrency for p in points][:2] == [64, 32]
    assert points[-1].within(SLO_MS)
    assert not any(p.within(SLO_MS) for p in points[:-1])


def test_a_climb_stops_when_throughput_stops_growing():
    climb = Climb(1000.0, 4, 128)
    for throughput in (100.0, 150.0, 152.0):
        level = climb.next_level()
        climb.record(LadderPoint(level, throughput, 1.0, 2.0, 3.0, 0))
    assert climb.next_level() is None
    assert [p.concurrency for p in climb.points] == [4, 8, 16]


def test_a_point_with_errors_never_meets_the_slo():
    assert not LadderPoint(4, 100.0, 1.0, 2.0, 3.0, errors=1).within(SLO_MS)
    assert not LadderPoint(4, 100.0, None, None, None, 0).within(SLO_MS)


def test_a_repeat_starts_where_the_first_run_was_best():
    candidate = Candidate(8, "idle", 0, 1, 1)
    first = Measurement(candidate, [measure_run(candidate, None)])
    assert ladder_start(candidate, first, SLO_MS) == first.best_point(SLO_MS).concurrency


def test_shapes_use_all_or_half_of_the_cores():
    assert server_shapes(2, (1, 1)) == [(1, 2), (2, 1)]
    assert set(server_shapes(16, (1, 16))) == {(2, 8), (4, 4), (8, 2), (16, 1), (1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(i * t <= 16 for i, t in server_shapes(16, (1, 1)))


def test_windows_much_longer_than_the_slo_are_not_tried():
    space = build_space(BASELINE, 20.0, 2, waits_ms=(2.0, 5.0, 10.0))
    assert space.waits_ms == (2.0, 5.0)
    assert space.batch_sizes == (1, 2, 4, 8, 16, 32, 64) and space.ceiling == 64


def test_the_search_starts_with_the_baseline_and_orders_cheap_changes_first():
    space = build_space(BASELINE, SLO_MS, 2)
    results, order = run_search(space)
    phases = [phase for phase, _ in order]
    assert order[0] == ("baseline", BASELINE.key)
    assert len({key for _, key in order if _ != "repeat"}) == len([o for o in order if o[0] != "repeat"])
    first = {name: phases.index(name) for name in dict.fromkeys(phases)}
    assert first["baseline"] < first["batch size"] < first["batching policy"] < first["instances x threads"] \
        < first["repeat"]
    # Every candidate before the restarts keeps the baseline's instances and threads: no restart.
    before = [results[key].candidate for phase, key in order[:first["instances x threads"]]]
    assert {c.server for c in before} == {BASELINE.server}


def test_the_recommendation_is_the_best_throughput_within_the_slo():
    space = build_space(BASELINE, SLO_MS, 2)
    results, _ = run_search(space)
    rec = recommend(results, SLO_MS, BASELINE)
    assert rec is not None
    best_score = max(m.score(SLO_MS) for m in results.values())
    assert rec.best.score(SLO_MS) == best_score
    assert rec.point.within(SLO_MS)
    # The fake machine rewards 8-row batches, idle batching and two threads.
    assert rec.best.candidate.max_batch_size >= 8 and rec.best.candidate.policy == "idle"
    assert rec.best.candidate.threads == 2 or rec.best.candidate.instances == 2
    assert rec.baseline_score is not None and rec.best.score(SLO_MS) > rec.baseline_score
    # The two finalists were measured twice each; their spread is what a repeat moved.
    finalists = Search(space).finalists(results)
    assert all(len(results[c.key].runs) == 2 for c in finalists)
    assert rec.spread == pytest.approx(0.03, abs=0.005)


def test_a_gap_smaller_than_the_spread_is_reported_as_noise():
    a = Candidate(8, "idle", 0, 1, 2)
    b = Candidate(16, "idle", 0, 1, 2)
    point = lambda rps: [LadderPoint(8, rps, 1.0, 2.0, 10.0, 0)]  # noqa: E731
    results = {a.key: Measurement(a, [point(100.0), point(90.0)]), b.key: Measurement(b, [point(97.0), point(99.0)])}
    rec = recommend(results, SLO_MS, BASELINE)
    assert rec.best.candidate == b and rec.runner_up.candidate == a  # worst runs 97 and 90
    assert rec.spread == pytest.approx(10.0 / 95.0)  # a's two runs differed by 10
    assert rec.within_noise  # a gap of 7% under a spread of 10%
    results[b.key] = Measurement(b, [point(150.0), point(152.0)])
    rec = recommend(results, SLO_MS, BASELINE)
    assert rec.best.candidate == b and not rec.within_noise


def test_a_setting_with_a_repeat_that_never_met_the_slo_is_not_recommended():
    """Two runs of `fast`: the first met the SLO at 8 clients, the repeat (from the same level)
    never did. Its median, 200 req/s, was above `steady`'s 155 only by averaging in a run that
    failed the SLO; it is not recommended at all."""
    fast = Candidate(8, "idle", 0, 1, 2)
    steady = Candidate(4, "idle", 0, 1, 2)
    results = {
        fast.key: Measurement(fast, [[LadderPoint(8, 400.0, 10.0, 20.0, 40.0, 0)],
                                     [LadderPoint(8, 210.0, 30.0, 60.0, 75.0, 0),
                                      LadderPoint(4, 190.0, 30.0, 55.0, 51.0, 0)]]),
        steady.key: Measurement(steady, [[LadderPoint(4, 150.0, 5.0, 9.0, 20.0, 0)],
                                         [LadderPoint(4, 160.0, 5.0, 9.0, 22.0, 0)]]),
    }
    assert results[fast.key].score(SLO_MS) == 0.0 and results[fast.key].quoted_point(SLO_MS) is None
    rec = recommend(results, SLO_MS, BASELINE)
    assert rec is not None and rec.best.candidate == steady and rec.runner_up is None
    assert rec.point == LadderPoint(4, 150.0, 5.0, 9.0, 20.0, 0)  # the worse of steady's two runs
    assert "in every run" in recommendation_text(None, SLO_MS, {fast.key: results[fast.key]})


def test_the_recommendation_quotes_the_worst_repeat():
    """The repeat broke the SLO at 8 clients and held at 4: the setting is still the best, but
    its figures are the repeat's (4 clients, p99 45 ms), not the first run's 8 clients."""
    best = Candidate(8, "idle", 0, 1, 2)
    other = Candidate(2, "idle", 0, 1, 2)
    first = [LadderPoint(4, 130.0, 5.0, 9.0, 20.0, 0), LadderPoint(8, 200.0, 10.0, 20.0, 30.0, 0)]
    repeat = [LadderPoint(8, 205.0, 20.0, 40.0, 60.0, 0), LadderPoint(4, 120.0, 15.0, 30.0, 45.0, 0)]
    results = {best.key: Measurement(best, [first, repeat]),
               other.key: Measurement(other, [[LadderPoint(2, 100.0, 3.0, 5.0, 8.0, 0)]])}
    rec = recommend(results, SLO_MS, BASELINE)
    assert rec is not None and rec.best.candidate == best
    assert rec.point == repeat[1] and rec.best.score(SLO_MS) == 120.0
    text = recommendation_text(rec, SLO_MS, results)
    assert "120.0 req/s" in text and "its worst of 2 runs, at 4 clients" in text and "p99 45.0 ms" in text
    (row,) = [c for c in results_json(results, SLO_MS) if c["key"] == best.key]
    assert row["quoted_point"]["p99_ms"] == 45.0 and row["score_rps"] == 120.0
    # Of two runs equally bad, the one with the higher p99 is quoted.
    tied = [LadderPoint(4, 120.0, 15.0, 30.0, 48.0, 0)]
    assert Measurement(best, [repeat, tied]).quoted_point(SLO_MS).p99_ms == 48.0


def test_nothing_is_recommended_when_no_setting_met_the_slo():
    bad = Measurement(BASELINE, [[LadderPoint(1, 50.0, 80.0, 90.0, 99.0, 0)]])
    assert recommend({BASELINE.key: bad}, SLO_MS, BASELINE) is None


def test_failed_candidates_are_skipped_and_never_proposed_again():
    space = build_space(BASELINE, SLO_MS, 2)
    results = {}
    results, _ = run_search(space, results, stop_after=1)
    step = Search(space).next(results)
    results[step[1].key] = Measurement(step[1], [], failure="server did not start")
    following = Search(space).next(results)
    assert following[1].key != step[1].key
    final, _ = run_search(space, results)
    assert final[step[1].key].failure == "server did not start" and not final[step[1].key].runs


def test_only_repeats_are_proposed_when_the_budget_is_kept_for_them():
    space = build_space(BASELINE, SLO_MS, 2)
    results, _ = run_search(space, stop_after=3)
    phase, candidate = Search(space).next(results, explore=False)
    assert phase == "repeat" and candidate.key in results


def test_an_interrupted_search_resumed_from_the_state_file_measures_the_same_settings(tmp_path):
    space = build_space(BASELINE, SLO_MS, 2)
    _, uninterrupted = run_search(space)
    context = {"model_yaml_sha256": "abc", "slo_p99_ms": SLO_MS}
    state = TuneState.open(tmp_path / "tune-state.json", context)
    partial, first_part = run_search(space, stop_after=5)
    for measurement in partial.values():
        state.record(measurement)
    resumed = TuneState.open(tmp_path / "tune-state.json", context)
    assert resumed.resumed == 5 and set(resumed.results) == set(partial)
    _, second_part = run_search(space, resumed.results)
    assert first_part + second_part == uninterrupted
    assert not set(key for _, key in second_part if _ != "repeat") & set(partial)


def test_candidate_keys_ignore_the_wait_of_the_idle_policy():
    assert Candidate(8, "idle", 25.0, 1, 1).key == Candidate(8, "idle", 0.0, 1, 1).key
    assert Candidate(8, "window", 5.0, 1, 1).key != Candidate(8, "window", 2.0, 1, 1).key
    patch = Candidate(8, "adaptive", 10.0, 1, 1).batching_patch(SLO_MS)
    assert patch == {"policy": "adaptive", "max_batch_size": 8, "max_wait_ms": 10.0, "latency_slo_ms": SLO_MS}
    assert "max_batch_size" not in Candidate(0, "idle", 0, 1, 1).batching_patch(SLO_MS)
