#!/usr/bin/env python3
"""N servewell replicas behind HAProxy on this machine, started and stopped by one command.

    python3 deploy/local/replicas.py up -n 3 --port 8000 [--servewell .venv/bin/servewell] [-- SERVE ARGS...]
    python3 deploy/local/replicas.py status | restart | down [--state-dir .replicas]

`up` runs in the foreground (`make replicas N=3` calls it): it starts the replicas on ports
port+1..port+N, one after another until each listens (so the first one alone builds the built-in
model), then HAProxy on `--port` (configuration: deploy/local/haproxy.cfg.template), and keeps
them running as a container orchestrator would:

- a replica that exits is taken out of HAProxy at once (`set server ... health down`, as an
  endpoint is removed when its pod dies) and started again (backoff when it keeps failing);
  it receives traffic again only when its /v2/health/ready passes HAProxy's checks;
- SIGHUP (or `restart`) restarts the replicas one at a time: drain in HAProxy, wait for its
  sessions to finish, SIGTERM, start again, wait until HAProxy sees it ready, next;
- SIGINT/SIGTERM (Ctrl-C, or `down`) stops every replica with SIGTERM (servewell drains its
  accepted requests), then HAProxy, each by its own pid, and any process a dead replica left in
  its session (its worker processes), also by pid.

Every replica requires an admin token (`SERVEWELL_ADMIN_TOKEN`, in its environment, not on its
command line where `ps` shows it): without one, servewell lets loopback clients use the admin
endpoints, and behind HAProxy every client would come from 127.0.0.1. The token is read from
`--admin-token-file` (default `--state-dir`/admin-token), written there (mode 0600) when the file
does not exist, and its path is printed at start: model control goes to a replica's own port with
`Authorization: Bearer $(cat .replicas/admin-token)`.

Each replica runs in its own session, so a Ctrl-C in the terminal reaches only this supervisor.
The state (pids, ports, the HAProxy admin socket) is kept in `--state-dir`/state.json, with one
log per process. Standard library only: it does not import servewell, and works with any
`servewell` executable.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "haproxy.cfg.template"
BACKEND = "replicas"
#: Seconds a replica gets to drain after SIGTERM before it is killed. servewell (uvicorn) finishes
#: accepted requests for up to 30 s, then stops its workers. [issue 12: --shutdown-timeout-s]
STOP_TIMEOUT_S = 40.0
#: A replica that exits sooner than this after its start counts as failing: its restarts back off.
STABLE_AFTER_S = 10.0
MAX_BACKOFF_S = 30.0
POLL_S = 0.1
#: Bytes of randomness in a generated admin token (43 URL-safe characters).
ADMIN_TOKEN_BYTES = 32


def log(message: str) -> None:
    """One line on stderr, with the time."""
    print(f"{time.strftime('%H:%M:%S')} replicas: {message}", file=sys.stderr, flush=True)


class HaproxyAdmin:
    """HAProxy's runtime API on its admin socket: one command per connection."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def command(self, text: str, timeout_s: float = 5.0) -> str:
        """Send one command; its whole answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(self.path))
            sock.sendall(text.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def servers(self) -> dict[str, dict[str, str]]:
        """`show stat` rows of the replicas backend's servers, by server name (status, scur, ...)."""
        text = self.command("show stat").lstrip("# ")
        return {
            row["svname"]: row
            for row in csv.DictReader(io.StringIO(text))
            if row.get("pxname") == BACKEND and row.get("svname") not in ("FRONTEND", "BACKEND")
        }

    def set_server(self, server: str, what: str) -> None:
        """`set server replicas/<server> <what>` (e.g. `state drain`, `health down`); failures are logged."""
        try:
            answer = self.command(f"set server {BACKEND}/{server} {what}").strip()
        except OSError as exc:
            answer = str(exc)
        if answer:
            log(f"haproxy: set server {server} {what}: {answer}")


@dataclass(slots=True)
class Replica:
    """One servewell process slot: a fixed name and port, the current process, its history."""

    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures: int = 0  # consecutive quick exits, for the backoff
    start_after: float = 0.0
    expected_exit: bool = False
    managed: bool = False  # started once: from then on, kept running
    sessions: list[int] = field(default_factory=list)  # session ids of processes started here

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def session_members(sid: int) -> list[int]:
    """Pids of the processes in session `sid` (read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # fields after the command: state ppid pgrp session ...
            members.append(int(entry.name))
    return members


def end_session(sid: int, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process still in a session we started (a dead replica's workers)."""
    deadline = time.monotonic() + grace_s
    sent_term = False
    while members := session_members(sid):
        if time.monotonic() > deadline:
            for pid in members:
                _signal(pid, signal.SIGKILL)
            return
        if not sent_term:
            for pid in members:
                _signal(pid, signal.SIGTERM)
            sent_term = True
        time.sleep(POLL_S)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def admin_token(path: Path) -> str:
    """The replicas' admin token: the first line of `path`, or a new random one written there (mode 0600)."""
    try:
        token = path.read_text().strip().splitlines()[0].strip() if path.exists() else ""
    except (OSError, IndexError):
        token = ""
    if path.exists() and not token:
        raise SystemExit(f"{path} holds no admin token: remove it to have one generated, or write one")
    if not token:
        token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
    return token


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def http_ok(port: int, path: str, timeout_s: float = 1.0) -> bool:
    """Whether GET http://127.0.0.1:port/path answers 200."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            return sock.recv(64).startswith((b"HTTP/1.1 200", b"HTTP/1.0 200"))
    except OSError:
        return False


class Supervisor:
    """Runs the replicas and HAProxy until told to stop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.state_dir: Path = args.state_dir.resolve()
        self.servewell: str = args.servewell
        self.serve_args: list[str] = args.serve_args
        self.host: str = args.host
        self.port: int = args.port
        ports = args.replica_ports or [args.port + 1 + i for i in range(args.replicas)]
        self.replicas = [Replica(f"r{i + 1}", p, self.state_dir / f"r{i + 1}.log") for i, p in enumerate(ports)]
        self.haproxy_bin: str = args.haproxy
        self.haproxy: subprocess.Popen | None = None
        self.admin = HaproxyAdmin(self.state_dir / "haproxy.sock")
        self.admin_token_file: Path = (args.admin_token_file or self.state_dir / "admin-token").resolve()
        self.admin_token = ""  # read or generated in run(), once the state directory exists
        self.stop_requested = False
        self.restart_requested = False

    # --- processes -----------------------------------------------------------------------

    def start_replica(self, replica: Replica) -> None:
        """Start `replica`'s servewell in a session of its own; its output goes to its log."""
        # HAProxy fronts HTTP only: the replicas' gRPC listeners are off (all N would want port 8001).
        command = [self.servewell, "serve", "--host", "127.0.0.1", "--port", str(replica.port), "--grpc-port", "0",
                   *self.serve_args]
        env = {**os.environ, "SERVEWELL_ADMIN_TOKEN": self.admin_token}
        with open(replica.log_path, "ab") as out:
            replica.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=env,
            )
        replica.sessions.append(replica.proc.pid)
        replica.managed = True
        replica.started_at = time.monotonic()
        replica.expected_exit = False
        log(f"{replica.name}: started pid {replica.proc.pid} on port {replica.port}")
        self.write_state()

    def start_haproxy(self) -> None:
        """Write haproxy.cfg from the template (checked with `haproxy -c`), start HAProxy, wait until it serves."""
        servers = "".join(f"    server {r.name} 127.0.0.1:{r.port}\n" for r in self.replicas)
        config = (
            TEMPLATE.read_text()
            .replace("@STATS_SOCKET@", str(self.admin.path))
            .replace("@BIND@", f"{self.host}:{self.port}")
            + servers
        )
        path = self.state_dir / "haproxy.cfg"
        path.write_text(config)
        check = subprocess.run([self.haproxy_bin, "-c", "-q", "-f", str(path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"haproxy rejects {path}:\n{check.stdout}{check.stderr}")
        with open(self.state_dir / "haproxy.log", "ab") as out:
            self.haproxy = subprocess.Popen(
                [self.haproxy_bin, "-db", "-f", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        # Listening and answering its admin socket is enough: its backends may still be loading.
        deadline = time.monotonic() + 10
        while not (listening(self.port) and self.admin.path.exists()):
            if self.haproxy.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"haproxy did not start; see {self.state_dir / 'haproxy.log'}")
            time.sleep(POLL_S)
        log(f"haproxy: pid {self.haproxy.pid}, serving http://{self.host}:{self.port}")
        self.write_state()

    def write_state(self) -> None:
        """state.json: pids, ports and paths, replaced atomically (read by `status`, `down` and tests)."""
        doc = {
            "supervisor_pid": os.getpid(),
            "url": f"http://{self.host}:{self.port}",
            "admin_token_file": str(self.admin_token_file),
            "haproxy": {
                "pid": self.haproxy.pid if self.haproxy else None,
                "admin_socket": str(self.admin.path),
                "config": str(self.state_dir / "haproxy.cfg"),
                "log": str(self.state_dir / "haproxy.log"),
            },
            "replicas": [
                {"name": r.name, "port": r.port, "pid": r.pid, "restarts": r.restarts, "log": str(r.log_path)}
                for r in self.replicas
            ],
        }
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(self.state_dir / "state.json")

    # --- the loop --------------------------------------------------------------------------

    def tick(self) -> None:
        """Notice exited replicas, take them out of HAProxy, restart them when their backoff allows."""
        if self.haproxy is not None and self.haproxy.poll() is not None:
            log(f"haproxy exited with {self.haproxy.returncode}; stopping")
            self.stop_requested = True
            return
        now = time.monotonic()
        for replica in self.replicas:
            proc = replica.proc
            if proc is not None and proc.poll() is not None:
                self.replica_exited(replica, proc.returncode, now)
            if replica.managed and replica.proc is None and now >= replica.start_after and not self.stop_requested:
                replica.restarts += 1
                self.start_replica(replica)

    def replica_exited(self, replica: Replica, code: int, now: float) -> None:
        """Out of HAProxy at once, its leftover processes ended, a restart scheduled (backoff if it keeps failing)."""
        assert replica.proc is not None
        pid = replica.proc.pid
        if self.haproxy is not None:
            self.admin.set_server(replica.name, "health down")
        end_session(pid)
        lived_s = now - replica.started_at
        replica.failures = 0 if replica.expected_exit or lived_s >= STABLE_AFTER_S else replica.failures + 1
        delay = min(MAX_BACKOFF_S, 2.0 ** (replica.failures - 1)) if replica.failures else 0.0
        log(
            f"{replica.name}: pid {pid} exited with {code} after {lived_s:.1f} s; "
            f"restarting{f' in {delay:g} s' if delay else ''}"
        )
        replica.proc = None
        replica.start_after = now + delay
        self.write_state()

    def wait_for(self, condition, timeout_s: float) -> bool:  # noqa: ANN001 - a predicate
        """Keep supervising until `condition()` holds (True) or the time is up / a stop is requested."""
        deadline = time.monotonic() + timeout_s
        while not self.stop_requested and time.monotonic() < deadline:
            self.tick()
            try:
                if condition():
                    return True
            except OSError:  # HAProxy's socket busy or a replica not listening yet: not yet
                pass
            time.sleep(POLL_S)
        return False

    def rolling_restart(self) -> None:
        """One replica at a time: drain in HAProxy, SIGTERM, restart, wait until HAProxy sees it UP."""
        log("rolling restart")
        for replica in self.replicas:
            if self.stop_requested:
                return
            if replica.proc is not None:
                self.admin.set_server(replica.name, "state drain")
                # HAProxy sends it nothing new now; let what it was given finish before SIGTERM.
                self.wait_for(lambda r=replica: self.admin.servers()[r.name]["scur"] == "0", 10.0)
                replica.expected_exit = True
                old_pid = replica.proc.pid
                replica.proc.send_signal(signal.SIGTERM)
                self.wait_for(
                    lambda r=replica, old=old_pid: (
                        r.proc is not None and r.proc.pid != old and http_ok(r.port, "/v2/health/ready")
                    ),
                    STOP_TIMEOUT_S + 300,
                )
            self.admin.set_server(replica.name, "state ready")
            if not self.wait_for(lambda r=replica: self.admin.servers()[r.name]["status"] == "UP", 30.0):
                log(f"{replica.name}: not UP in HAProxy after its restart; rolling restart stops here")
                return
            log(f"{replica.name}: restarted and serving")
        log("rolling restart done")

    def run(self) -> int:
        """Start everything, supervise until SIGINT/SIGTERM, stop everything; the exit status."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("state.json", "haproxy.sock"):  # from an earlier run: never mistaken for this one's
            (self.state_dir / stale).unlink(missing_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stop_requested", True))
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "restart_requested", True))
        self.admin_token = admin_token(self.admin_token_file)
        log(f"admin token: {self.admin_token_file} (model control goes to a replica's own port with "
            f"'Authorization: Bearer <token>'; HAProxy refuses it)")
        try:
            for replica in self.replicas:
                self.start_replica(replica)
                # One at a time until it listens: the first builds the built-in model, if any.
                self.wait_for(lambda r=replica: r.proc is None or http_ok(r.port, "/v2/health/live"), 300)
            if not self.stop_requested:
                self.start_haproxy()
            while not self.stop_requested:
                self.tick()
                if self.restart_requested:
                    self.restart_requested = False
                    self.rolling_restart()
                time.sleep(POLL_S)
        finally:
            self.stop_all()
        return 0

    def stop_all(self) -> None:
        """SIGTERM every replica (they drain), wait, kill what outlives STOP_TIMEOUT_S, then stop HAProxy."""
        log("stopping")
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in self.replicas:
            if replica.proc is not None:
                try:
                    replica.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log(
                        f"{replica.name}: still running {STOP_TIMEOUT_S:g} s after SIGTERM; "
                        f"killing pid {replica.proc.pid}"
                    )
                    replica.proc.kill()
                    replica.proc.wait()
                replica.proc = None
            for sid in replica.sessions:
                end_session(sid)
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                self.haproxy.wait(10)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                self.haproxy.wait()
        self.write_state()
        log("stopped")


# --- the other commands ------------------------------------------------------------------------


def read_state(state_dir: Path) -> dict:
    path = state_dir / "state.json"
    if not path.is_file():
        raise SystemExit(f"no replicas running here ({path} does not exist)")
    return json.loads(path.read_text())


def supervisor_pid(state: dict) -> int:
    """The pid of the running supervisor, checked against its command line (pids are reused)."""
    pid = state["supervisor_pid"]
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        raise SystemExit(f"the supervisor (pid {pid}) is not running") from None
    if Path(__file__).name.encode() not in cmdline:
        raise SystemExit(f"pid {pid} is not the replicas supervisor any more")
    return pid


def status(state_dir: Path) -> int:
    state = read_state(state_dir)
    print(f"{state['url']}  (supervisor pid {state['supervisor_pid']}, haproxy pid {state['haproxy']['pid']})")
    if state.get("admin_token_file"):
        print(f"admin token: {state['admin_token_file']}")
    try:
        servers = HaproxyAdmin(Path(state["haproxy"]["admin_socket"])).servers()
    except OSError as exc:
        servers = {}
        print(f"haproxy admin socket: {exc}")
    print(f"{'replica':8} {'port':>6} {'pid':>8} {'restarts':>8}  {'haproxy':10} {'sessions':>8} {'served':>8}  check")
    for r in state["replicas"]:
        s = servers.get(r["name"], {})
        print(
            f"{r['name']:8} {r['port']:>6} {r['pid'] or '-':>8} {r['restarts']:>8}  {s.get('status', '?'):10} "
            f"{s.get('scur', '?'):>8} {s.get('stot', '?'):>8}  {s.get('check_status', '')} {s.get('check_code', '')}"
        )
    return 0


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited child its parent has not reaped yet is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_supervisor(state_dir: Path, sig: int, wait: bool) -> int:
    pid = supervisor_pid(read_state(state_dir))
    os.kill(pid, sig)
    if wait:
        deadline = time.monotonic() + STOP_TIMEOUT_S + 20
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if running(pid):
            raise SystemExit(f"the supervisor (pid {pid}) is still running")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="replicas.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "status", "restart", "down"))
    parser.add_argument("-n", "--replicas", type=int, default=3, help="number of replicas (up)")
    parser.add_argument("--host", default="127.0.0.1", help="address HAProxy listens on (up)")
    parser.add_argument("--port", type=int, default=8000, help="HAProxy's port; replicas use port+1..port+N (up)")
    parser.add_argument(
        "--replica-ports",
        type=lambda s: [int(p) for p in s.split(",")],
        default=None,
        help="comma-separated replica ports instead of port+1..port+N (up)",
    )
    parser.add_argument(
        "--servewell",
        default=shutil.which("servewell") or "servewell",
        help="the servewell executable (up; default: the one on PATH)",
    )
    parser.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy", help="haproxy (up)")
    parser.add_argument("--state-dir", type=Path, default=Path(".replicas"), help="pids, configuration and logs")
    parser.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="the replicas' admin token (up; default: STATE_DIR/admin-token, generated when missing)",
    )
    parser.epilog = "Arguments after -- go to every `servewell serve` (up)."
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.serve_args = argv[split + 1 :]
    if args.replica_ports is not None:
        args.replicas = len(args.replica_ports)
    if args.replicas < 1:
        parser.error("-n must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "up":
        return Supervisor(args).run()
    if args.command == "status":
        return status(args.state_dir)
    if args.command == "restart":
        return signal_supervisor(args.state_dir, signal.SIGHUP, wait=False)
    return signal_supervisor(args.state_dir, signal.SIGTERM, wait=True)


if __name__ == "__main__":
    sys.exit(main())
