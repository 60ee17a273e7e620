"""The private copy of one version's files that its workers load (`VersionSnapshot`; the copies
themselves are engine/snapshot.py's): taken before its workers start, so a file overwritten in the
repository cannot reach a running worker; kept through an eviction, so the next load of the model
hard-links the files that did not change and reads weights the page cache still holds; released
otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.engine.model_files import model_files, unlisted_files
from servewell.engine.snapshot import Snapshot, SnapshotError, SnapshotStore

log = logging.getLogger("servewell.engine")


class VersionSnapshot:
    """One version's snapshot: taken once per load, released once."""

    __slots__ = ("_directory", "_store", "_label", "_name", "_taken")

    def __init__(self, name: str, label: str, directory: Path, store: SnapshotStore | None) -> None:
        self._name = name
        self._label = label
        self._directory = directory  # the model (or version) directory in the repository
        self._store = store  # None: workers read the repository's files directly
        self._taken: Snapshot | None = None

    async def take(self, config: ModelConfig) -> Path:
        """The directory the workers load: the snapshot of the files `config` uses, or the
        repository's directory itself when snapshots are off or one cannot be made."""
        store = self._store
        if store is None:
            return self._directory
        directory = self._directory

        def take() -> Snapshot:  # the files of the very config being loaded
            return store.take(directory, f"{self._name}-{config.version}", model_files(config, directory))

        try:
            snapshot = await asyncio.get_running_loop().run_in_executor(store.executor, take)
        except SnapshotError as exc:
            log.error("%s: %s; its workers read the repository's files directly, so overwriting them in place "
                      "can crash them", self._label, exc, extra={"model": self._name})
            return directory
        self._taken = snapshot
        log.info("%s: snapshot of %d files in %.3f s (%d MiB copied, %d MiB unchanged and linked)", self._label,
                 snapshot.files, snapshot.seconds, snapshot.copied_bytes >> 20, snapshot.reused_bytes >> 20,
                 extra={"model": self._name, "snapshot": str(snapshot.directory)})
        return snapshot.directory

    def explain(self, reason: str, loaded_from: Path) -> str:
        """A load failure's reason as the operator knows the files (by their repository path), with
        the files the snapshot left out when the failure names them."""
        directory = self._directory
        if loaded_from == directory:
            return reason
        unlisted = unlisted_files(reason, loaded_from, directory)
        if unlisted:
            reason += (f" ({', '.join(unlisted)}: in the model directory but not in its snapshot, which copies only "
                       "the files the model is known to use; list them in model.yaml's extra_files)")
        return reason.replace(str(loaded_from), str(directory))

    async def release(self) -> None:
        """Remove the snapshot (nothing when none was taken or it was released already)."""
        store, snapshot = self._store, self._taken
        self._taken = None
        if store is not None and snapshot is not None:
            await asyncio.get_running_loop().run_in_executor(store.executor, store.release, snapshot)
