"""Which files of a model directory a model uses: what its snapshot copies, and nothing else.

A snapshot once copied every file of the directory, so a data folder or a big sibling file
beside a 232 KB model made it copy 695 MB. It now copies, from the config being loaded:

- `model.yaml` and the artifact;
- the further files the artifact names, where its runtime's descriptor says how to find them
  (`artifact_files`; onnx: the external-data files the graph names, `engine.onnx_external_data`),
  relative to the artifact's directory, as the runtime resolves them;
- where the runtime imports the model's own code (`model_code`: pytorch and python), every `*.py`
  file (the factory or the entry class is imported from the model directory and may import its
  siblings and packages);
- the model's `extra_files`: names (a file, or a directory copied whole) and glob patterns
  (`*` and `?` within one path segment, `**` across any number of them).

Enumeration (for `*.py`, globs and directories) never enters a symlinked directory, nor
`__pycache__` and `.git`; a named file is taken as named, symlinks on its way included (an
artifact linked from a model store is common).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path, PurePosixPath

from servewell.config.model import ModelConfig, is_pattern
from servewell.config.model_file import CONFIG_FILE
from servewell.config.runtimes import resolve
from servewell.engine.snapshot import SnapshotError

#: Files listed while enumerating one model directory: a listing, not a crawl of a data set.
MAX_LISTED_FILES = 100_000
_SKIPPED_DIRECTORIES = frozenset(("__pycache__", ".git"))
#: Paths a failure reason may name, and so need a look in the repository.
_MAX_HINTS = 5


def model_files(config: ModelConfig, directory: Path) -> list[str]:
    """The paths (relative, POSIX) of the files `config`'s model uses in `directory`, in a stable
    order without repeats; a path may name a file that does not exist (the load then says so).
    `SnapshotError` when the ONNX graph cannot be read or the directory lists too many files."""
    chosen: dict[str, None] = {CONFIG_FILE: None, config.artifact: None}
    runtime = config.runtime_descriptor
    artifact = directory / config.artifact
    if runtime.artifact_files and artifact.is_file():
        base = PurePosixPath(config.artifact).parent
        try:
            named: list[str] = resolve(runtime.artifact_files)(artifact)
        except (ValueError, OSError) as exc:  # OnnxFormatError is a ValueError
            raise SnapshotError(f"cannot find the files that {artifact} names: {exc}") from None
        chosen.update((str(base / location), None) for location in named)
    code = runtime.model_code
    if code or config.extra_files:
        listed = list_files(directory)
        if code:
            chosen.update((path, None) for path in listed if path.endswith(".py"))
        for entry in config.extra_files:
            chosen.update((path, None) for path in matching(entry, directory, listed))
    return list(chosen)


def matching(entry: str, directory: Path, listed: list[str]) -> list[str]:
    """The paths one `extra_files` entry selects from `listed` (the files of `directory`)."""
    clean = str(PurePosixPath(entry))
    if is_pattern(entry):
        rule = _pattern(clean)
        return [path for path in listed if rule.fullmatch(path)]
    if (directory / clean).is_dir():
        prefix = "" if clean == "." else clean + "/"
        return [path for path in listed if path.startswith(prefix)]
    return [clean]


def _pattern(pattern: str) -> re.Pattern[str]:
    """A regex for a glob: `**` is any number of whole segments, `*` and `?` stay in one."""
    segments = pattern.split("/")
    out = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            out.append("(?:[^/]+/)*[^/]+" if last else "(?:[^/]+/)*")
        else:
            out.append(_segment(segment) + ("" if last else "/"))
    return re.compile("".join(out))


def _segment(segment: str) -> str:
    out, i = [], 0
    while i < len(segment):
        c = segment[i]
        close = segment.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif close != -1:
            body = segment[i + 1:close]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            out.append("[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def list_files(directory: Path) -> list[str]:
    """Every file under `directory` (relative, POSIX, sorted), symlinked directories not entered."""
    found: list[str] = []
    for root, subdirectories, names in os.walk(directory, followlinks=False):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_DIRECTORIES
                                   and not os.path.islink(os.path.join(root, d)))
        relative = PurePosixPath(Path(root).relative_to(directory).as_posix())
        found.extend(str(relative / name) for name in sorted(names))
        if len(found) > MAX_LISTED_FILES:
            raise SnapshotError(f"{directory} holds more than {MAX_LISTED_FILES} files; keep data sets out of "
                                "model directories")
    return found


def unlisted_files(reason: str, snapshot: Path, directory: Path) -> list[str]:
    """Files a failure `reason` names inside the snapshot that are missing there but exist in the
    repository's `directory`: the model reads a file the snapshot did not copy."""
    found: dict[str, None] = {}
    named = re.finditer(re.escape(str(snapshot)) + r"/([^\s'\"`,;:()\[\]]+)", reason)
    for match in itertools.islice(named, _MAX_HINTS * 4):
        relative = match.group(1).rstrip(".")
        if not (snapshot / relative).exists() and (directory / relative).exists():
            found[relative] = None
        if len(found) >= _MAX_HINTS:
            break
    return list(found)
