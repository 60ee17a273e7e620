"""Shared-memory segments are named after the frontend and the worker, so they can be removed by
name however their owner ended; a server that was killed is cleaned up after by the next one."""

from __future__ import annotations

import os

import numpy as np

from servewell.workers.handle import describe_exit
from servewell.workers.shm import (
    HeartbeatCell,
    SegmentReader,
    SharedArena,
    new_prefix,
    remove_segments,
    remove_stale_segments,
    shm_directory,
)


def names(prefix: str) -> list[str]:
    return sorted(p.name for p in shm_directory().glob(f"{prefix}-*"))


def test_a_worker_s_segments_go_by_its_prefix_even_those_nobody_closed() -> None:
    prefix = new_prefix()
    assert prefix.startswith(f"servewell-{os.getpid()}-")
    inputs = SharedArena(1024, prefix=f"{prefix}-in")
    outputs = SharedArena(1024, prefix=f"{prefix}-out")  # as a killed worker leaves its own arena
    beat = HeartbeatCell(f"{prefix}-hb", create=True)
    outputs.write({"y": np.zeros(10_000, dtype=np.float64)})  # grows: the outgrown one is removed at once
    assert names(prefix) == [f"{prefix}-hb", f"{prefix}-in0", f"{prefix}-out1"]
    other = new_prefix()
    bystander = SharedArena(1024, prefix=f"{other}-in")
    assert remove_segments(prefix) == 3
    assert names(prefix) == [] and names(other) == [f"{other}-in0"]  # a prefix is not a prefix of another
    inputs.close()  # closing after the sweep is harmless
    beat.close()
    bystander.close()


def test_the_heartbeat_cell_is_shared_between_its_owner_and_an_attacher() -> None:
    name = f"{new_prefix()}-hb"
    owner = HeartbeatCell(name, create=True)
    worker = HeartbeatCell(name, create=False)
    assert owner.read() == 0
    worker.write(41)
    worker.write(42)
    assert owner.read() == 42
    worker.close()
    owner.close()
    owner.unlink()
    assert not (shm_directory() / name).exists()


def test_segments_of_a_server_that_no_longer_runs_are_removed() -> None:
    dead = SharedArena(1024, prefix="servewell-999999999-1-in")  # no such process
    ours = SharedArena(1024, prefix=f"{new_prefix()}-in")
    reader = SegmentReader()
    assert remove_stale_segments() >= 1
    assert not (shm_directory() / dead.name).exists() and (shm_directory() / ours.name).exists()
    reader.close()
    ours.close()
    dead.close()


def test_exit_status_in_words() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL (exit code -9)"
    assert describe_exit(-7) == "killed by SIGBUS (exit code -7)"
    assert describe_exit(None) == "exit status unknown"
