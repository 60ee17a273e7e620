"""The supervisor against two tiny stand-in children (written here; not the real engine and ingress
mains): the listening socket reaches every ingress, a killed child comes back, a signal to the
whole process group shuts down in order (ingress processes first, the engine last and told
first), kill -9 of the supervisor takes the children with it, and nothing stays behind.

The children note what happens to them in one append-only file, in the order it happens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from processes import free_port
from servewell.process_tree import read_restart_counts, remove_stale_run_dirs
from waiting import eventually

ROOT = Path(__file__).resolve().parents[2]

_COMMON = """
import os, signal, socket, sys, time
from pathlib import Path
EVENTS = {events!r}
def note(role, text):
    with open(EVENTS, "a") as f:
        f.write(f"{{role}} {{os.getpid()}} {{text}}\\n")
"""

ENGINE = _COMMON + """
from servewell.child_process import read_settings
run = Path(sys.argv[1])
if "--standby" in sys.argv:  # engine_standby.py's contract: wait for one byte on the descriptor
    fd = int(sys.argv[sys.argv.index("--standby") + 1])
    note("standby", "waiting")
    if os.read(fd, 1) != b"\\x01":
        note("standby", "released")
        sys.exit(0)
    note("standby", "takes over")
settings, _ = read_settings(run)
if settings.default_model == "fatal":
    sys.exit(2)  # "this configuration can never work"
def on_signal(sig, frame):
    note("engine", signal.Signals(sig).name)
    if sig == signal.SIGTERM:
        note("engine", "exit")
        os._exit(0)
for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, on_signal)
note("engine", f"start run={{run}} port={{settings.port}}")
while True:
    signal.pause()
"""

INGRESS = _COMMON + """
run, index, fd = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
listener = socket.socket(fileno=fd)
listener.setblocking(True)
def on_term(sig, frame):
    note("ingress", f"{{index}} {{signal.Signals(sig).name}}")
    if os.environ.get("STAND_IN_INGRESS") == "stubborn":
        return  # never drains: only SIGKILL ends it
    time.sleep(0.3)  # a drain: the engine must not be told to stop before it ends
    note("ingress", f"{{index}} exit")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, on_term)
note("ingress", f"{{index}} start")
while True:
    conn, _ = listener.accept()
    conn.sendall(f"ingress {{index}} {{os.getpid()}}\\n".encode())
    conn.close()
"""

DRIVER = """
import asyncio, os, sys
from pathlib import Path
from servewell.config.server import ConfigSource, ServerConfig
from servewell.observability.logging import configure_logging
from servewell.supervisor import Supervisor
configure_logging("info", "json")
port, default_model, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
standby_after_s = os.environ.get("STAND_IN_STANDBY_AFTER_S")
settings = ServerConfig(port=port, shutdown_delay_s=0.2, shutdown_timeout_s=timeout_s, grpc_port=0,
                        default_model=default_model, standby_engine=standby_after_s is not None)
supervisor = Supervisor(settings, ConfigSource(None, {{}}), ingress_processes=2, engine_argv=[{engine!r}],
                        ingress_argv=[{ingress!r}], run_parent=Path({runs!r}),
                        standby_after_s=float(standby_after_s or 10))
code = asyncio.run(supervisor.serve())
print("restarts", supervisor.restart_counts())
sys.exit(code)
"""


@dataclass
class Tree:
    proc: subprocess.Popen[bytes]
    port: int
    events: Path
    log_path: Path
    runs: Path

    def lines(self) -> list[list[str]]:
        return [line.split() for line in self.events.read_text().splitlines()] if self.events.exists() else []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self, role: str, index: str | None = None) -> list[int]:
        """Pids of every start of `role` (ingress: with that index), oldest first."""
        return [int(w[1]) for w in self.lines() if w[0] == role and "start" in w
                and (index is None or w[2] == index)]

    def wait_started(self, engines: int = 1, ingress_each: int = 1) -> None:
        def started() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            return (len(self.pids("engine")) >= engines
                    and all(len(self.pids("ingress", str(i))) >= ingress_each for i in range(2)))

        eventually(started, 10, lambda: f"children did not start: {self.lines()}\n{self.log()[-3000:]}", 0.02)

    def ask(self) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            return conn.makefile().readline()


def start_tree(tmp_path: Path, default_model: str = "digits", port: int | None = None, shutdown_timeout_s: float = 2,
               env: dict[str, str] | None = None) -> Tree:
    events, runs = tmp_path / "events", tmp_path / "runs"
    runs.mkdir()
    engine, ingress, driver = tmp_path / "engine.py", tmp_path / "ingress.py", tmp_path / "driver.py"
    engine.write_text(ENGINE.format(events=str(events)))
    ingress.write_text(INGRESS.format(events=str(events)))
    driver.write_text(DRIVER.format(engine=str(engine), ingress=str(ingress), runs=str(runs)))
    port = port or free_port()
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log:
        # A session of its own: the test signals the supervisor's whole process group, as systemd would.
        proc = subprocess.Popen([sys.executable, str(driver), str(port), default_model, str(shutdown_timeout_s)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})
    return Tree(proc, port, events, log_path, runs)


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's pid 1 may not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def stop(tree: Tree) -> None:
    """End the supervisor and, should a test have failed, any child that outlived it."""
    if tree.proc.poll() is None:
        tree.proc.kill()
        tree.proc.wait(10)
    for pid in tree.pids("engine") + tree.pids("ingress"):
        if not dead(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_children_get_the_socket_come_back_when_killed_and_stop_in_order(tmp_path: Path, stop_signal: signal.Signals):
    tree = start_tree(tmp_path)
    try:
        tree.wait_started()
        engine_start = next(w for w in tree.lines() if w[0] == "engine")
        assert f"port={tree.port}" in engine_start  # RUN/settings.pickle reached it
        run_dir = Path(engine_start[3].removeprefix("run="))
        assert run_dir.parent == tree.runs and (run_dir.stat().st_mode & 0o777) == 0o700
        answers = {tree.ask().split()[0] for _ in range(4)}
        assert answers == {"ingress"}  # the inherited listening socket accepts in the ingress processes

        victim = tree.pids("ingress", "0")[0]
        os.kill(victim, signal.SIGKILL)
        tree.wait_started(ingress_each=1)
        eventually(lambda: len(tree.pids("ingress", "0")) == 2, 10, lambda: f"ingress 0 not restarted: "
                   f"{tree.lines()}\n{tree.log()[-3000:]}", 0.02)
        assert {tree.ask().split()[0] for _ in range(4)} == {"ingress"}
        os.kill(tree.pids("engine")[0], signal.SIGKILL)
        eventually(lambda: len(tree.pids("engine")) == 2, 10, lambda: f"engine not restarted: {tree.lines()}", 0.02)
        log = tree.log()
        assert f'"event":"child_exited","role":"ingress","index":0,"pid":{victim},"signal":"SIGKILL"' in log, log
        assert '"event":"child_restart_scheduled","role":"engine"' in log

        assert read_restart_counts(run_dir) == {"engine": 1, "ingress": 1}  # for the engine's metrics
        engine = tree.pids("engine")[-1]
        os.kill(tree.proc.pid, signal.SIGHUP)
        eventually(lambda: ["engine", str(engine), "SIGHUP"] in tree.lines(), 10, "SIGHUP not passed on", 0.02)

        ingresses = [tree.pids("ingress", str(i))[-1] for i in range(2)]
        os.killpg(tree.proc.pid, stop_signal)  # systemd, a container's stop, make, Ctrl-C: the whole group
        assert tree.proc.wait(20) == 0, tree.log()[-3000:]
    finally:
        stop(tree)
    events = [" ".join(w[:1] + w[2:]) for w in tree.lines() if int(w[1]) in (engine, *ingresses)]
    assert events.index("engine SIGUSR1") < events.index("engine SIGTERM")
    for i in range(2):
        # Each ingress got the signal once (from the supervisor only) and had exited before the engine got SIGTERM.
        assert events.count(f"ingress {i} {stop_signal.name}") == 1, events
        assert events.index(f"ingress {i} exit") < events.index("engine SIGTERM"), events
    assert all(dead(pid) for pid in (engine, *ingresses))
    assert list(tree.runs.iterdir()) == []  # RUN removed
    assert "restarts {'engine': 1, 'ingress': 1}" in tree.log()


def test_kill_9_of_the_supervisor_takes_the_children_and_the_next_start_removes_its_run_dir(tmp_path: Path):
    tree = start_tree(tmp_path)
    try:
        tree.wait_started()
        children = tree.pids("engine") + tree.pids("ingress")
        os.kill(tree.proc.pid, signal.SIGKILL)
        tree.proc.wait(10)
        eventually(lambda: all(dead(pid) for pid in children), 10,
                   lambda: f"children outlived their supervisor: {[p for p in children if not dead(p)]}", 0.02)
    finally:
        stop(tree)
    left = list(tree.runs.iterdir())
    assert len(left) == 1  # nobody was there to remove it...
    assert remove_stale_run_dirs(tree.runs) == left  # ...so the next supervisor does, at start
    assert list(tree.runs.iterdir()) == []


def test_a_port_in_use_exits_1_with_one_line_and_starts_nothing(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tree = start_tree(tmp_path, port=taken.getsockname()[1])
        try:
            assert tree.proc.wait(20) == 1
        finally:
            stop(tree)
    lines = [line for line in tree.log().splitlines() if not line.startswith("restarts")]  # the driver's own
    assert len(lines) == 1 and '"event":"listen_failed"' in lines[0] and "address already in use" in lines[0], lines
    assert tree.lines() == [] and list(tree.runs.iterdir()) == []


def test_a_child_that_exits_2_is_not_restarted_and_the_supervisor_stops_with_2(tmp_path: Path):
    tree = start_tree(tmp_path, default_model="fatal")  # the stand-in engine exits 2 on it
    try:
        tree.wait_started(engines=0)
        assert tree.proc.wait(20) == 2, tree.log()[-3000:]
    finally:
        stop(tree)
    assert '"event":"child_fatal","role":"engine"' in tree.log()
    assert all(dead(pid) for pid in tree.pids("ingress"))
    assert list(tree.runs.iterdir()) == []


def test_a_second_sigterm_kills_the_children_that_would_still_drain(tmp_path: Path):
    # The stand-in ingress processes ignore SIGTERM; the supervisor would wait 0.2 + 60 + 5 s for them.
    tree = start_tree(tmp_path, shutdown_timeout_s=60, env={"STAND_IN_INGRESS": "stubborn"})
    try:
        tree.wait_started()
        os.kill(tree.proc.pid, signal.SIGTERM)
        eventually(lambda: sum("SIGTERM" in w for w in tree.lines()) == 2, 10, "the ingress processes got no SIGTERM",
                   0.02)
        os.kill(tree.proc.pid, signal.SIGTERM)
        assert tree.proc.wait(30) == 0, tree.log()[-3000:]
    finally:
        stop(tree)
    log = tree.log()
    assert "SIGTERM again: stopping now" in log and '"event":"shutdown_forced"' in log
    assert all(dead(pid) for pid in tree.pids("engine") + tree.pids("ingress"))
    assert list(tree.runs.iterdir()) == []


def test_a_standby_engine_takes_over_when_the_engine_dies_and_another_stands_by(tmp_path: Path):
    # Issue 45 H15: most of a killed engine's recovery went to the new engine's imports; a standby
    # has done them and takes over at once.
    tree = start_tree(tmp_path, env={"STAND_IN_STANDBY_AFTER_S": "0.3"})
    try:
        tree.wait_started()
        standbys = lambda: [int(w[1]) for w in tree.lines() if w[0] == "standby" and w[2] == "waiting"]  # noqa: E731
        eventually(standbys, 10, lambda: f"no standby: {tree.lines()}\n{tree.log()[-3000:]}", 0.02)
        first_standby = standbys()[0]
        engine = tree.pids("engine")[0]
        assert first_standby != engine
        os.kill(engine, signal.SIGKILL)
        eventually(lambda: len(tree.pids("engine")) == 2, 10, lambda: f"no engine again: {tree.lines()}", 0.02)
        assert tree.pids("engine")[1] == first_standby  # the standby took over: no new process was started
        assert ["standby", str(first_standby), "takes", "over"] in tree.lines()
        assert f'"event":"child_started","role":"engine","index":0,"pid":{first_standby},"standby":true' in tree.log()
        eventually(lambda: len(standbys()) == 2, 10, lambda: f"no second standby: {tree.lines()}", 0.02)
        second_standby = standbys()[1]
        assert second_standby not in (engine, first_standby)
        os.killpg(tree.proc.pid, signal.SIGTERM)
        assert tree.proc.wait(20) == 0, tree.log()[-3000:]
    finally:
        stop(tree)
    assert dead(second_standby) and dead(first_standby)  # nothing stays behind, the standby neither
    assert ["standby", str(second_standby), "released"] in tree.lines()
