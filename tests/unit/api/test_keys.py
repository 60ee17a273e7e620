"""The HTTP side of the API keys (api/keys.py): the credentials a request presents, the 401 challenge,
and keys swapped live."""

from __future__ import annotations

import pytest

from servewell.api.keys import InferenceAccess, presented_key
from servewell.errors import Unauthorized
from servewell.tenancy.keys import KeyRing, parse_keys

SECRET_A = "a" * 20
SECRET_B = "b-secret-key-0123456789"


def test_access_check() -> None:
    access = InferenceAccess(KeyRing(parse_keys([f"a:{SECRET_A} rate=1", f"b:{SECRET_B}"], "k")))
    assert access.check(f"Bearer {SECRET_B}", None) == "b"
    assert access.check(None, SECRET_B) == "b"
    with pytest.raises(Unauthorized) as missing:
        access.check(None, None)
    assert missing.value.headers == {"WWW-Authenticate": 'Bearer realm="servewell"'}
    with pytest.raises(Unauthorized) as wrong:
        access.check("Bearer nope-nope-nope-nope", None)
    assert 'error="invalid_token"' in wrong.value.headers["WWW-Authenticate"]
    with pytest.raises(Unauthorized):
        access.check(f"Basic {SECRET_B}", None)  # only bearer credentials
    # A key's rate is its tenant's quota, one bucket for the whole server (engine/tenants.py): the
    # key check itself never refuses for rate, so one quota has one 429 code.
    assert [access.check(None, SECRET_A) for _ in range(5)] == ["a"] * 5
    assert (access.key_id_of(None, SECRET_A), access.key_id_of("Bearer nope-nope-nope-nope", None)) == ("a", "")
    assert access.tenant_of("a") == "a" and access.tenant_of("") == ""


def test_without_keys_everything_is_allowed_and_keys_can_be_revoked_live() -> None:
    access = InferenceAccess(KeyRing())
    assert access.check(None, None) is None
    access.replace(KeyRing(parse_keys([f"a:{SECRET_A}"], "k")), None)
    assert access.check(None, SECRET_A) == "a"
    access.replace(KeyRing(parse_keys([f"b:{SECRET_B}"], "k")), None)  # a rotated out
    with pytest.raises(Unauthorized):
        access.check(None, SECRET_A)


def test_a_ring_that_requires_keys_but_holds_none_denies_everyone() -> None:
    # What a reload to zero keys leaves: it once logged "0 API key(s) in force" and opened inference.
    access = InferenceAccess(KeyRing(parse_keys([f"a:{SECRET_A}"], "k")))
    access.replace(KeyRing((), required=True), None)
    assert access.enabled
    with pytest.raises(Unauthorized):
        access.check(None, None)
    with pytest.raises(Unauthorized):
        access.check(None, SECRET_A)
    assert not KeyRing().enabled  # nothing configured, ever: open, as documented


def test_the_presented_key_is_x_api_key_else_a_bearer_credential() -> None:
    assert presented_key(None, SECRET_A) == SECRET_A
    assert presented_key(f"Bearer  {SECRET_B} ", None) == SECRET_B
    assert presented_key(f"bearer {SECRET_B}", SECRET_A) == SECRET_A  # X-API-Key wins
    assert presented_key(f"Basic {SECRET_B}", None) is None  # another scheme presents no key
    assert presented_key("Bearer ", None) is None and presented_key(None, "") is None
