"""The tuner's state file (`tune-state.json` in --out): every measurement so far, under the
context it was measured in. A rerun with the same context skips what is measured; a changed
context (another model.yaml, SLO, step length, protocol, machine) starts afresh and keeps the
old file beside it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servewell.perf.tuner import Candidate, LadderPoint, Measurement

STATE_VERSION = 1


def measurement_to_json(m: Measurement) -> dict[str, Any]:
    """A measurement as plain JSON."""
    return {"candidate": asdict(m.candidate), "runs": [[asdict(p) for p in run] for run in m.runs],
            "failure": m.failure}


def measurement_from_json(doc: dict[str, Any]) -> Measurement:
    """Inverse of `measurement_to_json`."""
    return Measurement(Candidate(**doc["candidate"]), [[LadderPoint(**p) for p in run] for run in doc["runs"]],
                       doc.get("failure"))


class TuneState:
    """Measurements by candidate key, saved after each one (atomically: a crash never leaves half a file)."""

    def __init__(self, path: Path, context: dict[str, Any]) -> None:
        self.path = path
        self.context = context
        self.results: dict[str, Measurement] = {}
        self.resumed = 0  # measurements taken from the file
        self.note: str | None = None  # what happened to an existing file

    @classmethod
    def open(cls, path: Path, context: dict[str, Any]) -> TuneState:
        """Load `path` when its context matches; otherwise start empty (the old file kept as .old)."""
        state = cls(path, context)
        if not path.is_file():
            return state
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            same = doc.get("version") == STATE_VERSION and doc.get("context") == json.loads(json.dumps(context))
            results = {k: measurement_from_json(v) for k, v in doc.get("results", {}).items()} if same else {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            same, results = False, {}
            state.note = f"{path} could not be read ({exc}); starting afresh"
        if not same:
            old = path.with_name(path.name + ".old")
            os.replace(path, old)
            state.note = state.note or f"{path} was measured with other settings; kept as {old.name}, starting afresh"
            return state
        state.results = results
        state.resumed = len(results)
        return state

    def record(self, measurement: Measurement) -> None:
        """Store (or replace) a candidate's measurement and save."""
        self.results[measurement.candidate.key] = measurement
        self.save()

    def save(self) -> None:
        """Write the file whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"version": STATE_VERSION, "context": self.context,
               "results": {k: measurement_to_json(m) for k, m in self.results.items()}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
