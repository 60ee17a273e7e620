"""The cold-start breakdown of a worker start (workers/cold_start.py) and the spare count's default."""

from __future__ import annotations

import pytest

from servewell.config.server import ServerConfig
from servewell.workers.cold_start import breakdown_of
from servewell.workers.messages import WorkerReady
from servewell.workers.spare import effective_load_cpu_policy, effective_spare_workers, effective_warmup_first_only


def test_the_steps_are_measured_from_the_request_across_the_pipe():
    info = WorkerReady(pid=42, load_s=0.9, warmup_s=0.25, rss_bytes=1, began_at=101.5, import_s=0.5, weights_s=0.4)
    b = breakdown_of("m", 0, info, requested_at=100.0, ready_at=103.0, spare=False, fresh_reason="no spare was idle")
    assert (b.spawn_s, b.import_s, b.load_s, b.warmup_s, b.total_s) == (1.5, 0.5, 0.4, 0.25, 3.0)
    assert b.other_s == pytest.approx(0.35)
    assert b.as_dict()["fresh_reason"] == "no spare was idle" and b.as_dict()["spare"] is False


def test_a_worker_that_does_not_say_when_it_began_counts_the_rest_as_spawn():
    info = WorkerReady(pid=42, load_s=1.0, warmup_s=0.5, rss_bytes=1)
    b = breakdown_of("m", 0, info, requested_at=10.0, ready_at=12.0, spare=False)
    assert (b.spawn_s, b.import_s, b.load_s, b.warmup_s) == (0.5, 0.0, 1.0, 0.5)


def test_the_spare_count_defaults_to_one_in_the_lazy_mode_only_and_can_be_set():
    assert effective_spare_workers(ServerConfig()) == 0  # eager: every load happens at start
    assert effective_spare_workers(ServerConfig(repository_mode="lazy")) == 1  # requests wait for loads
    assert effective_spare_workers(ServerConfig(repository_mode="lazy", spare_workers=0)) == 0
    assert effective_spare_workers(ServerConfig(spare_workers=3)) == 3
    with pytest.raises(ValueError):
        ServerConfig(spare_workers=-1)


def test_the_warm_up_of_the_first_batch_sizes_only_is_the_lazy_mode_s_default_and_can_be_set():
    assert not effective_warmup_first_only(ServerConfig())  # eager: every size, as before
    assert effective_warmup_first_only(ServerConfig(repository_mode="lazy"))
    assert not effective_warmup_first_only(ServerConfig(repository_mode="lazy", warmup_batch_sizes="all"))
    assert effective_warmup_first_only(ServerConfig(warmup_batch_sizes="first"))
    assert not effective_warmup_first_only(ServerConfig(warmup_batch_sizes="all"))


def test_loads_run_at_idle_priority_by_default_in_lazy_mode_only():
    assert effective_load_cpu_policy(ServerConfig()) == "normal"  # eager: starts and restarts come back first
    assert effective_load_cpu_policy(ServerConfig(repository_mode="lazy")) == "idle"
    assert effective_load_cpu_policy(ServerConfig(repository_mode="lazy", load_cpu_policy="normal")) == "normal"
    assert effective_load_cpu_policy(ServerConfig(load_cpu_policy="idle")) == "idle"
