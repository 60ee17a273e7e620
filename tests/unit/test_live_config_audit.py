"""What the audit trail keeps of a keys file and a model.yaml (live_config.py): key ids and fields,
a rotated key as a new version, never a key; a config's nested sections as dotted names."""

from __future__ import annotations

from servewell.live_config import flat, key_table
from servewell.tenancy.keys import parse_keys

SECRET = "a-key-that-must-never-be-kept-0123"


def test_keys_are_kept_by_id_and_fields_and_a_rotation_shows_as_a_new_version() -> None:
    salt = b"s" * 16
    before = key_table(parse_keys([f"alpha:{SECRET} tenant=team weight=2"], "keys.txt"), salt)
    after = key_table(parse_keys([f"alpha:{SECRET}-rotated tenant=team weight=2"], "keys.txt"), salt)
    assert set(before) == {"alpha"} and before["alpha"]["tenant"] == "team" and before["alpha"]["weight"] == 2
    assert before["alpha"]["version"] != after["alpha"]["version"]  # rotated under the same id
    assert SECRET not in str(before) + str(after)
    assert key_table(parse_keys([f"alpha:{SECRET} tenant=team weight=2"], "k"), b"t" * 16)["alpha"]["version"] \
        != before["alpha"]["version"]  # another process's salt: the version means nothing outside it


def test_a_config_dump_is_flattened_to_dotted_names() -> None:
    assert flat({"batching": {"max_wait_ms": 5, "lanes": ["a"]}, "cache": None, "name": "m"}) == {
        "batching.max_wait_ms": 5, "batching.lanes": ["a"], "cache": None, "name": "m"}
