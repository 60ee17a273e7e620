"""Build the example models into a model repository: `python -m servewell.examples.build digits --out REPO`.

Builds are idempotent (a stamp file records which builder version made a model, and a
current model is left alone) and atomic (a model is built in a hidden directory next to its
target and renamed into place), so a crash never leaves a half-built model for the server.
Runs in its own process: it imports torch, which the server's frontend never does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.examples.artifacts import ProgressFn
from servewell.perf.progress import LineSink

#: Written into each built model directory; says which builder (and version) made it.
STAMP_FILE = ".servewell-build.json"


def print_progress(message: str) -> None:
    """The default progress sink: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class ExampleBuilder:
    """How to build one example model."""

    name: str
    #: Bump when the built model would differ (training, preprocessing, export), so old builds are redone.
    version: int
    #: Runtimes it can build for; the first is the default.
    runtimes: tuple[str, ...]
    #: Writes the model's files into an existing empty directory, for a runtime.
    build: Callable[[Path, ProgressFn, str], ModelConfig]


def _build_digits(model_dir: Path, progress: ProgressFn, runtime: str) -> ModelConfig:
    from servewell.examples.digits import build_digits

    return build_digits(model_dir, progress)


def _build_resnet50(model_dir: Path, progress: ProgressFn, runtime: str) -> ModelConfig:
    from servewell.examples.resnet import build_resnet50

    return build_resnet50(model_dir, progress, runtime)


def _pipeline_part(name: str) -> Callable[[Path, ProgressFn, str], ModelConfig]:
    """The builder of one model of the example pipelines (examples/pipelines.py)."""
    def build(model_dir: Path, progress: ProgressFn, runtime: str) -> ModelConfig:
        from servewell.examples import pipelines

        builder: Callable[[Path, ProgressFn], ModelConfig] = getattr(pipelines, PIPELINE_PARTS[name])
        return builder(model_dir, progress)

    return build


#: The models of the example pipelines, by name -> their builder in examples/pipelines.py.
PIPELINE_PARTS = {
    "digits_crop": "build_crop", "digits_format": "build_format", "digits_linear": "build_linear",
    "digits_average": "build_average", "digits_page": "build_page_pipeline",
    "digits_ensemble": "build_ensemble_pipeline",
}

def _generative_part(name: str) -> Callable[[Path, ProgressFn, str], ModelConfig]:
    """The builder of one generative example (examples/generative.py)."""
    def build(model_dir: Path, progress: ProgressFn, runtime: str) -> ModelConfig:
        from servewell.examples import generative

        builder: Callable[[Path, ProgressFn], ModelConfig] = getattr(generative, f"build_{name}")
        return builder(model_dir, progress)

    return build


#: The generative examples (examples/generative.py): streams, continuous batching, the OpenAI API.
GENERATIVE = ("charlm", "charlm_gen", "char_embed")

#: The example models, by name.
BUILDERS: dict[str, ExampleBuilder] = {
    "digits": ExampleBuilder("digits", 1, ("onnx",), _build_digits),
    # Version 2: the pytorch build's model.yaml names its factory in the `pytorch:` section.
    "resnet50": ExampleBuilder("resnet50", 2, ("onnx", "torchscript", "pytorch"), _build_resnet50),
    **{name: ExampleBuilder(name, 1, ("python",) if name not in ("digits_page", "digits_ensemble") else ("pipeline",),
                            _pipeline_part(name)) for name in PIPELINE_PARTS},
    **{name: ExampleBuilder(name, 1, ("python",), _generative_part(name)) for name in GENERATIVE},
}
#: Names that build several models: the example pipelines and every model they use.
GROUPS: dict[str, tuple[str, ...]] = {"pipelines": ("digits", *PIPELINE_PARTS), "generative": GENERATIVE}


def build_model(
    name: str,
    repository: Path,
    runtime: str | None = None,
    progress: ProgressFn = print_progress,
    *,
    force: bool = False,
) -> Path:
    """Build example model `name` into `repository/name` unless a current build is already there.

    `runtime` defaults to the builder's first runtime. Progress lines are passed to `progress`
    prefixed with the model name ("digits: training epoch 3/8 ..."). Concurrent builds of the
    same model wait for each other. Returns the model directory. Raises ValueError for an
    unknown model or runtime; a failed build leaves any previous build in place.
    """
    builder = BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown example model {name!r}; choose from {', '.join(BUILDERS)}")
    runtime = runtime or builder.runtimes[0]
    if runtime not in builder.runtimes:
        raise ValueError(f"{name} builds for {', '.join(builder.runtimes)}, not {runtime!r}")
    stamp = {"builder": name, "version": builder.version, "runtime": runtime}
    repository = Path(repository)
    target = repository / name

    def report(message: str) -> None:
        progress(f"{name}: {message}")

    repository.mkdir(parents=True, exist_ok=True)
    if not force and _is_current(target, stamp):
        report(f"up to date in {target}")
        return target
    with _build_lock(repository, name):
        # Another process may have finished the same build while this one waited.
        if not force and _is_current(target, stamp):
            report(f"up to date in {target}")
            return target
        _remove_leftovers(repository, name)
        workdir = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=repository))
        try:
            builder.build(workdir, report, runtime)
            (workdir / STAMP_FILE).write_text(json.dumps(stamp) + "\n", encoding="utf-8")
            _make_readable(workdir)
            _swap_into_place(workdir, target)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    report(f"ready in {target}")
    return target


def _is_current(target: Path, stamp: dict[str, object]) -> bool:
    try:
        found = json.loads((target / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return found == stamp and (target / "model.yaml").is_file()


@contextmanager
def _build_lock(repository: Path, name: str) -> Iterator[None]:
    """An exclusive lock per model and repository (POSIX; elsewhere builds are not serialised)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(repository / f".{name}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(repository: Path, name: str) -> None:
    """Delete work directories of builds that crashed; safe because the caller holds the lock."""
    for pattern in (f".{name}.building-*", f".{name}.old-*"):
        for leftover in repository.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _make_readable(workdir: Path) -> None:
    """Give the build the permissions of ordinary files: mkdtemp makes its directory private (0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(workdir, 0o777 & ~umask)
    for path in workdir.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _swap_into_place(workdir: Path, target: Path) -> None:
    """Rename the finished build onto `target`, replacing an older build.

    A directory cannot be renamed over a non-empty one, so the old build is first renamed
    aside: for a moment the model is absent, but it is never half-written.
    """
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    if target.exists():
        os.rename(target, old)
    os.rename(workdir, target)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m servewell.examples.build", description="Build an example model into a model repository."
    )
    parser.add_argument("model", choices=sorted([*BUILDERS, *GROUPS]),
                        help="example model to build (pipelines: the example pipelines and their models)")
    parser.add_argument("--out", required=True, type=Path, help="model repository directory")
    parser.add_argument("--runtime", choices=["onnx", "torchscript", "pytorch"], help="runtime to build for")
    parser.add_argument("--force", action="store_true", help="rebuild even if a current build exists")
    args = parser.parse_args(argv)
    # On a terminal each step (training epochs, export) replaces the last; in a log, one line each.
    progress = LineSink()
    try:
        for name in GROUPS.get(args.model, (args.model,)):
            build_model(name, args.out, args.runtime if name == args.model else None, progress, force=args.force)
    except ValueError as exc:
        progress.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
