"""The audit trail (observability/audit.py): who changed what, when, from what to what; bounded,
logged once per change, and never holding a secret."""

from __future__ import annotations

import logging

import orjson
import pytest
from pydantic import SecretStr

from servewell.observability.audit import MAX_VALUE_CHARS, AuditTrail, actor_name, changed_fields, public_value

SECRET = "s3cret-value-never-kept"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def test_a_change_is_kept_with_when_who_what_old_and_new_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    trail = AuditTrail(clock=clock)
    with caplog.at_level(logging.INFO, logger="servewell.audit"):
        entry = trail.record_fields("key ops", "admin API", "batching", "digits", {"max_wait_ms": 5, "policy": "x"},
                                    {"max_wait_ms": 20, "policy": "x"})
    assert entry is not None
    (kept,) = trail.to_json()
    assert kept == {"at": 1_000.0, "who": "key ops", "via": "admin API", "what": "batching", "target": "digits",
                    "old": {"max_wait_ms": 5}, "new": {"max_wait_ms": 20},
                    "summary": "batching of digits: max_wait_ms"}
    (line,) = [vars(r) for r in caplog.records if getattr(r, "event", None) == "audit"]
    assert line["who"] == "key ops" and line["old"] == {"max_wait_ms": 5} and line["new"] == {"max_wait_ms": 20}


def test_nothing_is_recorded_when_nothing_changed() -> None:
    trail = AuditTrail()
    assert trail.record_fields("file", "file reload", "settings", "c.yaml", {"a": 1}, {"a": 1}) is None
    assert trail.to_json() == [] and trail.recorded == 0


def test_secrets_are_never_held_nor_logged(caplog: pytest.LogCaptureFixture) -> None:
    trail = AuditTrail()
    with caplog.at_level(logging.INFO, logger="servewell.audit"):
        trail.record_fields("file", "file reload", "settings", "c.yaml",
                            {"admin_token": None, "alerting": {"webhook_url": None}, "api_keys": []},
                            {"admin_token": SECRET, "alerting": {"webhook_url": SecretStr(SECRET)},
                             "api_keys": [f"alpha:{SECRET}"]})
        trail.record("file", "file reload", "settings", "c.yaml", {"hook": SecretStr(SECRET)}, SecretStr(SECRET))
    dumped = orjson.dumps(trail.to_json()).decode() + "\n".join(str(vars(r)) for r in caplog.records)
    assert SECRET not in dumped
    (first, second) = trail.to_json()
    assert first["new"]["admin_token"] == "(changed)" and first["old"]["admin_token"] == "(unset)"
    assert first["new"]["api_keys"] == "(changed)"
    assert first["new"]["alerting"] == {"webhook_url": "(set)"}
    assert second["old"] == {"hook": "(set)"} and second["new"] == "(set)"


def test_a_setting_named_like_a_file_of_keys_is_not_a_secret() -> None:
    assert public_value("api_keys_file", "/etc/servewell/keys.txt") == "/etc/servewell/keys.txt"
    assert public_value("admin_token", "x") == "(set)"


def test_the_ring_is_bounded_and_counts_every_change() -> None:
    trail = AuditTrail(capacity=3)
    for i in range(5):
        trail.record("admin", "admin API", "cache", f"m{i}", None, i)
    assert [e["target"] for e in trail.to_json()] == ["m2", "m3", "m4"] and trail.recorded == 5


def test_a_long_value_is_cut_and_says_so() -> None:
    trail = AuditTrail()
    trail.record("file", "file reload", "model file", "m", "x" * 10, "y" * (MAX_VALUE_CHARS * 3))
    new = trail.to_json()[0]["new"]
    assert isinstance(new, str) and len(new) < MAX_VALUE_CHARS + 60 and new.endswith("characters, cut)")


def test_entries_filter_by_time_target_and_limit() -> None:
    clock = Clock()
    trail = AuditTrail(clock=clock)
    for i, target in enumerate(("a", "b", "a", "a")):
        clock.t = 100.0 + i
        trail.record("admin", "admin API", "cache", target, i, i + 1)
    assert [e.at for e in trail.entries(since=100.5)] == [101.0, 102.0, 103.0]
    assert [e.at for e in trail.entries(target="a", limit=2)] == [102.0, 103.0]


def test_changed_fields_counts_a_field_only_one_side_has() -> None:
    assert changed_fields({"a": 1}, {"a": 1, "b": 2}) == ({"b": None}, {"b": 2})


def test_who_an_admin_caller_is() -> None:
    assert actor_name("ops") == "key ops" and actor_name(None) == "admin"
