"""Whether an inference request will be refused before its body is needed (`EarlyRefusal`), and
if not, its promise of a place in its model's lane while its body arrives (engine/promised.py).

For the OIP inference paths (the model in the path) and `/predict?model=NAME`. The HTTP protocol
defers starting the app until a body that is still arriving is all in (a slow
body costs no task: api/http_limits.py). A request its model's full lane would refuse must not
wait for its body though: it is answered at once (issue 46: refusals under overload took 42 ms,
the time to read, decode and ship the body to the engine). This predicate, run on the request's
head only, says so; the app then starts at once and the route's admission check (the same one,
`InferenceCall.open`) refuses it with the usual error, counts and logs, before reading the body.
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import unquote_plus

from servewell.api.dataplane import DataPlane
from servewell.api.keys import InferenceAccess
from servewell.api.state import AppState
from servewell.engine.promised import Promise

#: The OIP inference paths (a model in the path: the model is known before the body).
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class EarlyRefusal:
    """`refused_early(scope)` for `api/http_limits.py`: cheap, synchronous, never raises. True: it
    will be refused; else the promise of a place its request holds until the app starts."""

    __slots__ = ("_plane", "_access")

    def __init__(self, plane: DataPlane, access: InferenceAccess) -> None:
        self._plane = plane
        self._access = access

    @classmethod
    def of(cls, app: Any) -> EarlyRefusal:
        """The check for an app `api/app.py` built (its data plane and keys)."""
        state: AppState = app.state.servewell
        return cls(state.plane, state.access)

    def __call__(self, scope: Any) -> Literal[True] | Promise | None:
        if scope.get("method") != "POST":
            return None
        path = scope.get("path", "")
        match = _INFER_PATH.fullmatch(path)
        if match is not None:
            name, version = match.group(1), match.group(2)
        elif path == "/predict":  # only with the model in its query (routes_simple.py)
            name, version = _query_model(scope.get("query_string", b"")), None
            if not name:
                return None
        else:
            return None
        authorization = api_key = urgency = None
        for header, value in scope.get("headers", ()):
            if header == b"x-api-key":
                api_key = value.decode("latin-1")
            elif header == b"authorization":
                authorization = value.decode("latin-1")
            elif header == b"x-urgency":
                urgency = value.decode("latin-1")
        tenant = self._access.tenant_of(self._access.key_id_of(authorization, api_key))
        return self._plane.admit_early(name, version, urgency, tenant)


def _query_model(query: bytes) -> str | None:
    """`model=` of a query string (the last one, as Starlette reads it), or None."""
    found = None
    for pair in query.split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == b"model":
            found = unquote_plus(value.decode("latin-1"))
    return found
