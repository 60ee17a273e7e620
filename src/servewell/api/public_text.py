"""Text from the engine made fit for unauthenticated answers: no absolute file paths.

A model's load error names the files it read (`/srv/models/digits/1/model.onnx`, or its private
snapshot under the cache directory). `/healthz` is open to anyone who can reach the port, so it
shows such paths relative to the model repository (or the cache directory), and any other
absolute path by its last two components; the full text stays in the log and `/admin` answers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# An absolute path: a slash not preceded by a word character, then at least two components.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s'\"/:;,()<>\[\]{}]+/)+[^\s'\"/:;,()<>\[\]{}]*")


def without_paths(text: str | None, roots: Iterable[Path | None]) -> str | None:
    """`text` with every path under one of `roots` made relative to it, and any other absolute
    path cut to `.../<parent>/<name>`."""
    if not text:
        return text
    for root in roots:
        if root is None:
            continue
        for form in {str(root), str(root.resolve())}:
            text = text.replace(form.rstrip("/") + "/", "")
    return _ABSOLUTE_PATH.sub(lambda match: ".../" + "/".join(match.group(0).rstrip("/").rsplit("/", 2)[-2:]), text)


def public_rollout(rollout: dict[str, Any] | None, roots: Iterable[Path | None]) -> dict[str, Any] | None:
    """A model's traffic split as /healthz and the console show it to anyone: its state, the
    weights in force, the shadow, each other version's state, and the verdict's reason (full
    detail: GET /admin/models/{name}/rollout)."""
    if rollout is None:
        return None
    shadow, versions = rollout.get("shadow"), rollout.get("versions")
    return {"state": rollout["state"], "stable": rollout["stable"], "weights": rollout["weights"],
            "reason": without_paths(rollout.get("reason"), roots), "changed_at": rollout["changed_at"],
            "shadow": {k: shadow[k] for k in ("version", "percent")} if isinstance(shadow, dict) else None,
            "versions": {v: doc["state"] for v, doc in versions.items()} if isinstance(versions, dict) else {}}
