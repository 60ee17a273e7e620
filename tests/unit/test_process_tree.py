"""The stateless parts of the supervisor's process tree: how many ingress processes by default,
the restart backoff, the children's command lines, the private run directory and the settings in
it, the stale run directories of killed supervisors, and the public listening socket."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from servewell.child_process import ENGINE_DOOR_SOCKET, SETTINGS_FILE, read_settings, write_settings
from servewell.config.server import ConfigSource, ServerConfig, load_server_config
from servewell.process_tree import (
    DEFAULT_MAX_INGRESS_PROCESSES,
    ListenError,
    RestartBackoff,
    bind_listener,
    check_port_free,
    engine_command,
    ingress_command,
    ingress_process_count,
    make_run_dir,
    read_restart_counts,
    remove_run_dir,
    remove_stale_run_dirs,
    usable_cpus,
    write_restart_counts,
)
from servewell.supervisor import Supervisor

#: Above Linux's largest pid_max (2**22): no process ever has it.
NEVER_A_PID = 2**22 + 1


@pytest.mark.parametrize(("cpus", "expected"), [(0, 1), (1, 1), (2, 2), (8, 8), (64, DEFAULT_MAX_INGRESS_PROCESSES)])
def test_default_count_is_one_per_usable_cpu_between_1_and_8(cpus: int, expected: int):
    assert ingress_process_count(None, cpus) == expected


def test_a_configured_count_wins_and_0_means_single_process():
    assert ingress_process_count(0, 16) == 0
    assert ingress_process_count(12, 2) == 12
    assert ingress_process_count(None) == min(DEFAULT_MAX_INGRESS_PROCESSES, max(1, usable_cpus()))


def test_backoff_restarts_at_once_then_doubles_from_a_tenth_of_a_second_to_5_s_and_resets_after_a_long_run():
    backoff = RestartBackoff()
    assert [backoff.delay_after(0.5) for _ in range(9)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert backoff.delay_after(29.9) == 5.0  # short of 30 s: still a crash loop
    assert backoff.delay_after(30.0) == 0.0  # it ran 30 s: a fresh failure, restarted at once
    assert backoff.delay_after(1.0) == 0.1


def test_command_lines_follow_the_contract(tmp_path: Path):
    assert engine_command(tmp_path, python="/py") == ["/py", "-m", "servewell.engine_main", str(tmp_path)]
    assert ingress_command(tmp_path, 3, 7, python="/py") == ["/py", "-m", "servewell.ingress_main", str(tmp_path),
                                                             "3", "7"]
    assert ingress_command(tmp_path, 0, 5, ["stand_in.py"], "/py") == ["/py", "stand_in.py", str(tmp_path), "0", "5"]


def test_the_run_dir_is_private_holds_the_settings_and_is_removed(tmp_path: Path):
    run = make_run_dir(tmp_path)
    assert run.parent == tmp_path and f"-{os.getpid()}-" in run.name
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    settings = ServerConfig(port=9123, ingress_processes=2)
    source = ConfigSource(None, {"port": 9123})
    write_settings(run, settings, source)
    assert stat.S_IMODE((run / SETTINGS_FILE).stat().st_mode) == 0o600
    assert read_settings(run) == (settings, source)
    assert read_restart_counts(run) == {}
    write_restart_counts(run, {"engine": 1, "ingress": 3})
    assert read_restart_counts(run) == {"engine": 1, "ingress": 3}
    remove_run_dir(run)
    assert not run.exists()
    remove_run_dir(run)  # gone already: fine


def test_the_default_run_dir_leaves_room_for_the_socket_names():
    run = make_run_dir()
    try:
        assert len(str(run / ENGINE_DOOR_SOCKET)) < 108  # Linux's sun_path
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
    finally:
        remove_run_dir(run)


def test_only_run_dirs_of_supervisors_that_no_longer_run_are_removed(tmp_path: Path):
    dead = tmp_path / f"servewell-run-{NEVER_A_PID}-abc"
    live = tmp_path / f"servewell-run-{os.getpid()}-def"
    other = tmp_path / "servewell-run-notapid-x"
    for path in (dead, live, other):
        path.mkdir()
    (dead / "engine-door.sock").write_text("")
    assert remove_stale_run_dirs(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_the_listener_is_bound_once_inheritable_and_accepts():
    with bind_listener("127.0.0.1", 0) as listener:
        assert listener.get_inheritable()
        with socket.create_connection(listener.getsockname(), timeout=2):
            conn, _ = listener.accept()
            conn.close()


def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as raised:
            bind_listener("127.0.0.1", port)
    assert raised.value.strerror == (f"error while attempting to bind on address ('127.0.0.1', {port}): "
                                     "address already in use")


def test_a_port_shared_with_so_reuseport_is_not_free():
    # What an ingress of another server holds on its gRPC port: a later SO_REUSEPORT bind would share it.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as raised:
            check_port_free("127.0.0.1", port)
        assert "address already in use" in raised.value.strerror
    check_port_free("127.0.0.1", port)  # free again once closed


def test_an_ipv6_literal_binds_ipv6():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        listener = bind_listener("::1", 0)
    except ListenError as exc:
        pytest.skip(f"IPv6 loopback unavailable: {exc}")
    with listener:
        assert listener.family == socket.AF_INET6


def test_the_setting_comes_from_env_file_and_flag(tmp_path: Path):
    assert ServerConfig().ingress_processes is None
    assert load_server_config(None, {}, {"SERVEWELL_INGRESS_PROCESSES": "0"}).ingress_processes == 0
    config = tmp_path / "servewell.yaml"
    config.write_text("ingress_processes: 3\n")
    assert load_server_config(config, {"ingress_processes": 4}, {}).ingress_processes == 4
    with pytest.raises(ValueError, match="ingress_processes"):
        load_server_config(None, {}, {"SERVEWELL_INGRESS_PROCESSES": "-1"})


def test_a_supervisor_needs_an_ingress_process():
    with pytest.raises(ValueError):
        Supervisor(ServerConfig(), ConfigSource(None, {}), ingress_processes=0)
    assert Supervisor(ServerConfig(), ConfigSource(None, {}), ingress_processes=1).restart_counts() == {
        "engine": 0, "ingress": 0}
