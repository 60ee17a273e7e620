"""The readiness policies on (name, state) lists: what each says, and why."""

from __future__ import annotations

from servewell.engine.protocol import ModelState
from servewell.engine.readiness import evaluate_readiness

GOOD_AND_FAILED: list[tuple[str, ModelState]] = [("a", "ready"), ("b", "failed")]


def test_any_keeps_the_server_ready_with_a_failed_model_and_says_it_is_degraded() -> None:
    verdict = evaluate_readiness("any", (), GOOD_AND_FAILED, accepting=True)
    assert verdict.ready and verdict.degraded and verdict.status == "degraded" and "b (failed)" in verdict.reason


def test_any_waits_until_every_first_load_has_finished() -> None:
    verdict = evaluate_readiness("any", (), [("a", "ready"), ("b", "loading")], accepting=True)
    assert not verdict.ready and "b" in verdict.reason


def test_any_needs_at_least_one_ready_model() -> None:
    assert not evaluate_readiness("any", (), [("a", "failed"), ("b", "invalid")], accepting=True).ready
    assert not evaluate_readiness("any", (), [], accepting=True).ready


def test_a_restarting_model_does_not_take_the_server_out_under_any() -> None:
    assert evaluate_readiness("any", (), [("a", "ready"), ("b", "restarting")], accepting=True).ready


def test_strict_needs_every_model_ready_and_counts_invalid_ones() -> None:
    assert not evaluate_readiness("strict", (), GOOD_AND_FAILED, accepting=True).ready
    assert not evaluate_readiness("strict", (), [("a", "ready"), ("c", "invalid")], accepting=True).ready
    verdict = evaluate_readiness("strict", (), [("a", "ready"), ("b", "ready")], accepting=True)
    assert verdict.ready and verdict.status == "ok"


def test_unloaded_models_do_not_count() -> None:
    assert evaluate_readiness("strict", (), [("a", "ready"), ("old", "unloaded")], accepting=True).ready


def test_required_models_look_only_at_the_listed_ones() -> None:
    assert evaluate_readiness("required-models", ("a",), GOOD_AND_FAILED, accepting=True).ready
    verdict = evaluate_readiness("required-models", ("a", "b"), GOOD_AND_FAILED, accepting=True)
    assert not verdict.ready and "b (failed)" in verdict.reason
    missing = evaluate_readiness("required-models", ("zzz",), GOOD_AND_FAILED, accepting=True)
    assert not missing.ready and "zzz" in missing.reason


def test_a_server_that_is_shutting_down_is_never_ready() -> None:
    for policy in ("any", "strict", "required-models"):
        verdict = evaluate_readiness(policy, ("a",), [("a", "ready")], accepting=False)
        assert not verdict.ready and verdict.status == "shutting_down"
