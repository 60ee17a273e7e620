"""An automatic rollback or promotion of a traffic split reaches the audit trail (api/diagnosis_evidence.py
`ServerViews.watch_rollouts`): by `rollout rules`, at the time the split's state changed, once."""

from __future__ import annotations

from typing import Any

from servewell.api.diagnosis_evidence import ServerViews
from servewell.observability.console_feed import ConsoleFeed


class Rollout:
    """A traffic split's public document, as engine/rollout.py's `to_json` gives it."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] = {"state": "canary", "weights": {"1": 90, "2": 10}, "changed_at": 100.0,
                                    "reason": None}

    def to_json(self) -> dict[str, Any]:
        return dict(self.doc)


class Slot:
    def __init__(self, rollout: Rollout | None) -> None:
        self.rollout = rollout


class Registry:
    def __init__(self, slots: dict[str, Slot]) -> None:
        self.slots = slots


class Engine:
    """What the watch reads of the engine: its registry's slots (engine/model_registry.py)."""

    def __init__(self, slots: dict[str, Slot]) -> None:
        self.registry = Registry(slots)


def test_a_rollback_by_the_rules_is_recorded_once_at_its_time() -> None:
    rollout = Rollout()
    feed = ConsoleFeed(None)
    views = ServerViews(Engine({"m": Slot(rollout), "plain": Slot(None)}), feed)  # type: ignore[arg-type]
    views.watch_rollouts()  # the first look is the baseline: nothing changed yet
    assert feed.audit.to_json() == []
    rollout.doc.update(state="rolled_back", weights={"1": 100, "2": 0}, changed_at=160.5,
                       reason="version 2 failed 30% of 40 requests against 0% (error_rate)")
    views.watch_rollouts()
    views.watch_rollouts()  # seen again: not recorded twice
    (entry,) = feed.audit.to_json()
    assert entry["who"] == "rollout rules" and entry["via"] == "automatic" and entry["at"] == 160.5
    assert entry["what"] == "traffic" and entry["target"] == "m" and entry["old"] == {"state": "canary"}
    assert entry["new"]["weights"] == {"1": 100, "2": 0} and "error_rate" in entry["summary"]


def test_an_admins_change_of_weights_is_not_taken_for_the_rules() -> None:
    rollout = Rollout()
    feed = ConsoleFeed(None)
    views = ServerViews(Engine({"m": Slot(rollout)}), feed)  # type: ignore[arg-type]
    views.watch_rollouts()
    rollout.doc.update(state="steady", weights={"1": 100}, changed_at=170.0)  # the admin API records its own
    views.watch_rollouts()
    assert feed.audit.to_json() == []
