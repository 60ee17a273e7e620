"""A runtime's pre-flight check for `servewell models`, in a child process of its own:

    python -m servewell.runtimes.check_child MODEL_DIR < config.json

Reads the model's config as JSON from stdin and calls the check its runtime's descriptor names
(config/runtimes.py `RuntimeCheck`: the factory built on the meta device, the entry class
imported, the ONNX graph opened) as `function(config, model_dir)`. Prints one JSON object,
`{"problems": [{"field": ..., "reason": ...}], "notes": [...]}`, and exits 0 whether or not there
are problems; what the check or the model's own code prints goes to stderr, so that it cannot
garble the answer.

It runs in its own process because a check imports the framework or the model's own code, which
may hang, crash, print or change the process; the CLI stays free of them (repository_report.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.problems import FieldProblem
from servewell.config.runtimes import resolve


def run_check(config: ModelConfig, model_dir: Path) -> tuple[list[FieldProblem], list[str]]:
    """The problems and notes of `config`'s runtime check (none for a runtime without one)."""
    check = config.runtime_descriptor.check
    if check is None:
        return [], []
    with contextlib.redirect_stdout(sys.stderr):
        found = resolve(check.function)(config, model_dir)
    problems, notes = found if isinstance(found, tuple) else (found, [])
    return list(problems), [str(note) for note in notes]


def main(argv: list[str] | None = None) -> int:
    """Read the config as JSON from stdin, run its runtime's check in MODEL_DIR, print problems and notes as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servewell.runtimes.check_child MODEL_DIR < config.json", file=sys.stderr)
        return 2
    config = ModelConfig.model_validate_json(sys.stdin.read())
    problems, notes = run_check(config, Path(args[0]))
    print(json.dumps({"problems": [{"field": p.field, "reason": p.reason} for p in problems], "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
