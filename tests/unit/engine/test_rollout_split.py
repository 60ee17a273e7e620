"""How a `Rollout` (engine/rollout.py) draws versions, keeps a client on one, takes an admin's
weights and applies the judge's verdicts; the entries are stand-ins with a version and a state."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, cast

import pytest

from inference_requests import request_of
from servewell.config.model import ModelConfig
from servewell.engine.model_lifecycle import RolloutPhase, VersionLifecycle, VersionPhase
from servewell.engine.rollout import Rollout, judged_error
from servewell.errors import InvalidInput, ModelError, NotFound, Overloaded, WorkerLost

BASE = {"name": "m", "runtime": "onnx", "artifact": "m.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}


class Version:
    """What `Rollout.choose` reads of a version's entry: its version and its lifecycle."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.lifecycle = VersionLifecycle(VersionPhase.READY)

    def ready_entry(self) -> Version:
        return self


def rollout(**fields: Any) -> tuple[Rollout, Any]:
    config = ModelConfig.model_validate({**BASE, **fields})
    split = Rollout("m", config, None)
    split.candidates = {"2": cast(Any, Version("2"))}
    split.configure(config, None)
    return split, Version("1")


def draws(split: Rollout, stable: Any, n: int) -> Counter[str]:
    return Counter(split.choose(stable, None).version for _ in range(n))


def test_weights_split_requests_that_name_no_version() -> None:
    split, stable = rollout(traffic={"1": 80, "2": 20}, rollout={"sticky": "none"})
    counts = draws(split, stable, 5000)
    assert 0.17 < counts["2"] / 5000 < 0.23, counts
    assert split.lifecycle.state == "canary" and split.canaries() == ["2"]


def test_a_route_key_or_tenant_keeps_a_client_on_one_version_and_spreads_clients() -> None:
    split, stable = rollout(traffic={"1": 50, "2": 50})
    chosen = {}
    for user in range(200):
        request = request_of({}, route_key=f"user-{user}")
        versions = {split.choose(stable, None, request).version for _ in range(5)}
        assert len(versions) == 1
        chosen[user] = versions.pop()
    assert 60 < sum(v == "2" for v in chosen.values()) < 140
    tenant_a = request_of({}, tenant="tenant-a")  # no route key: the tenant decides
    assert len({split.choose(stable, None, tenant_a).version for _ in range(20)}) == 1


def test_a_version_asked_for_wins_and_an_unknown_one_is_404() -> None:
    split, stable = rollout(traffic={"1": 100, "2": 0})
    assert split.choose(stable, "2").version == "2"
    assert split.choose(stable, "1") is stable
    with pytest.raises(NotFound):
        split.choose(stable, "9")


def test_a_version_that_is_not_serving_is_never_drawn() -> None:
    split, stable = rollout(traffic={"1": 0, "2": 100})
    split.candidates["2"].lifecycle.workers_lost("its last worker died")
    assert set(draws(split, stable, 50)) == {"1"}
    split.candidates["2"].lifecycle.workers_back()
    split.candidates["2"].lifecycle.draining("unloading")  # being stopped: takes no new request either
    assert set(draws(split, stable, 50)) == {"1"}


def test_an_admin_sets_weights_and_null_returns_to_the_file() -> None:
    split, stable = rollout(traffic={"1": 90, "2": 10})
    split.set_by_admin({"1": 0, "2": 1}, ...)
    assert set(draws(split, stable, 50)) == {"2"} and split.admin_set
    with pytest.raises(NotFound):
        split.set_by_admin({"3": 1}, ...)
    with pytest.raises(NotFound):
        split.set_by_admin(..., 50)  # no shadow configured
    split.set_by_admin(None, ...)
    assert split.weights == {"1": 90.0, "2": 10.0} and not split.admin_set


def test_a_bad_canary_is_rolled_back_and_the_stable_version_never_is() -> None:
    split, stable = rollout(traffic={"1": 50, "2": 50},
                            rollout={"rollback": {"min_requests": 10, "max_error_rate_increase": 0.1}})
    for i in range(40):
        split.judge.request_done("1", time.monotonic(), 0.001, False)
        split.judge.request_done("2", time.monotonic(), 0.001, i % 3 == 0)
    verdict = split.judge_now()
    assert verdict is not None and verdict.action == "rollback" and verdict.version == "2"
    assert split.lifecycle.phase is RolloutPhase.ROLLED_BACK and split.weights["2"] == 0.0
    assert split.lifecycle.alert_reason == verdict.reason
    assert set(draws(split, stable, 50)) == {"1"}
    assert split.gauges().rolled_back == {"1": 0.0, "2": 1.0}
    # A changed traffic in model.yaml ends the verdict: the file wins.
    changed = ModelConfig.model_validate({**BASE, "traffic": {"1": 70, "2": 30}})
    split.configure(changed, None)
    assert split.lifecycle.state == "canary" and split.weights == {"1": 70.0, "2": 30.0}


def test_only_a_versions_own_failures_count_against_it() -> None:
    assert judged_error(ModelError("boom")) and judged_error(WorkerLost("gone"))
    assert not judged_error(InvalidInput("bad")) and not judged_error(Overloaded("full"))
    assert not judged_error(None) and not judged_error(RuntimeError("not a ServeError"))


def test_a_good_canary_is_promoted_when_asked_and_only_then() -> None:
    for promote, expected in ((30, "promoted"), (None, "canary")):
        split, stable = rollout(traffic={"1": 90, "2": 10},
                                rollout={"rollback": {"min_requests": 10, "promote_after_requests": promote}})
        for _ in range(40):
            split.judge.request_done("1", time.monotonic(), 0.001, False)
            split.judge.request_done("2", time.monotonic(), 0.001, False)
        split.judge_now()
        assert split.lifecycle.state == expected
        if promote is not None:
            assert split.weights == {"2": 100.0} and set(draws(split, stable, 30)) == {"2"}


def test_a_split_whose_canary_left_says_steady_and_canary_again_when_it_is_back() -> None:
    # The same weights in model.yaml, but the canary's version left the split (its directory was
    # removed, or it failed to load): no canary takes traffic, so the split is steady (it said canary).
    split, stable = rollout(traffic={"1": 80, "2": 20})
    assert split.gauges().state == "canary"
    config = ModelConfig.model_validate({**BASE, "traffic": {"1": 80, "2": 20}})
    canary = split.candidates.pop("2")
    split.configure(config, config)
    assert split.gauges().state == "steady" and set(draws(split, stable, 30)) == {"1"}
    split.candidates["2"] = canary  # it loaded again: it takes its share, judged
    split.configure(config, config)
    assert split.gauges().state == "canary" and split.canaries() == ["2"]
