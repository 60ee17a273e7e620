"""The keys file's entries (tenancy/keys.py): parsing, constant-time identification, the tenants and
roles the entries name, and the policies the engine enforces from them."""

from __future__ import annotations

import hashlib

import pytest

from servewell.tenancy.keys import KeyFormatError, KeyRing, check_distinct, key_digest, parse_keys

SECRET_A = "a" * 20
SECRET_B = "b-secret-key-0123456789"


def test_entries_in_every_form() -> None:
    keys = parse_keys([
        "# a comment",
        "",
        SECRET_A,
        f"team-b:{SECRET_B}  rate=5   # trailing comment",
        f"ci:{key_digest('c' * 32)}",
    ], "keys.txt")
    assert [k.id for k in keys] == [f"key-{hashlib.sha256(SECRET_A.encode()).hexdigest()[:8]}", "team-b", "ci"]
    assert keys[1].rate_per_s == 5.0 and keys[0].rate_per_s is None
    ring = KeyRing(keys)
    assert (found := ring.identify(SECRET_B)) is not None and found.id == "team-b"
    assert (found := ring.identify("c" * 32)) is not None and found.id == "ci"  # only the hash was configured
    assert ring.identify("wrong-key-of-enough-length") is None
    assert ring.identify("x" * 100_000) is None  # an oversized credential is not even hashed


@pytest.mark.parametrize("line, problem", [
    ("short", "at least 16"),
    ("bad!id:" + "k" * 20, "key id"),
    ("x:sha256:1234", "64 hexadecimal"),
    ("k" * 20 + " rate=0", "positive"),
    ("k" * 20 + " colour=blue", "unexpected field"),
])
def test_malformed_entries_name_the_line_but_never_the_key(line: str, problem: str) -> None:
    with pytest.raises(KeyFormatError) as info:
        parse_keys(["# header", line], "keys.txt")
    assert "keys.txt: entry 2" in str(info.value) and problem in str(info.value)
    assert "k" * 20 not in str(info.value)


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(KeyFormatError, match="twice"):
        parse_keys([f"a:{SECRET_A}", f"a:{SECRET_B}"], "keys.txt")


@pytest.mark.parametrize("lines", [
    [f"a:{SECRET_A}", f"b:{SECRET_A}"],  # one key under two ids
    [f"a:{SECRET_A} tenant=x", f"b:{SECRET_A} tenant=y"],  # ... and two tenants
    [f"a:{SECRET_A}", f"b:{key_digest(SECRET_A)}"],  # once as the key, once as its hash
    [SECRET_A, f"b:{SECRET_A}"],  # once without an id
])
def test_one_key_in_two_entries_is_refused_naming_both_entries_but_not_the_key(lines: list[str]) -> None:
    # Issue 45 H7: the later entry won silently (the caller became the other id, of another tenant).
    with pytest.raises(KeyFormatError) as info:
        parse_keys(["# keys", *lines], "keys.txt")
    message = str(info.value)
    assert "keys.txt: entry 3" in message and "keys.txt: entry 2" in message and "same key" in message
    assert SECRET_A not in message and hashlib.sha256(SECRET_A.encode()).hexdigest() not in message


@pytest.mark.parametrize("field", ["tenant=x tenant=y", "tenant=x tenant=x", "rate=1 rate=2", "weight=1 weight=2",
                                   "role=operator role=tenant", "queue=1 queue=1", "concurrency=3 concurrency=4"])
def test_a_field_twice_on_a_line_is_refused(field: str) -> None:
    with pytest.raises(KeyFormatError, match=r"keys.txt: entry 1: \w+= appears twice on the line"):
        parse_keys([f"a:{SECRET_A} {field}"], "keys.txt")


def test_a_key_in_the_file_and_in_the_variable_is_refused() -> None:
    # load_keys (live_config.py) checks the two sources together with check_distinct.
    keys = [*parse_keys([f"a:{SECRET_A}"], "keys.txt"), *parse_keys([f"env:{SECRET_A}"], "SERVEWELL_API_KEYS")]
    with pytest.raises(KeyFormatError, match="SERVEWELL_API_KEYS: entry 1: the same key as keys.txt: entry 1"):
        check_distinct(keys)
    keys = [*parse_keys([f"a:{SECRET_A}"], "keys.txt"), *parse_keys([f"a:{SECRET_B}"], "SERVEWELL_API_KEYS")]
    with pytest.raises(KeyFormatError, match="key id 'a' appears twice .first at keys.txt: entry 1"):
        check_distinct(keys)


def test_operator_keys() -> None:
    keys = parse_keys([f"ops:{SECRET_A} role=operator tenant=ops", f"b:{SECRET_B} role=tenant", f"c:{'c' * 20}"], "k")
    assert [k.operator for k in keys] == [True, False, False]
    with pytest.raises(KeyFormatError, match="role must be tenant or operator"):
        parse_keys([f"a:{SECRET_A} role=admin"], "k")
