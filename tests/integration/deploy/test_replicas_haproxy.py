"""Replicas behind a real HAProxy (deploy/local/replicas.py), under steady load through it.

Two servewell replicas of a tiny ONNX model run under the supervisor, which keeps them running
as an orchestrator would (restarts a replica that exits) and configures HAProxy from
deploy/local/haproxy.cfg.template (active checks on /v2/health/ready, retry-on conn-failure and
empty-response with redispatch). Client threads send OIP requests through HAProxy the whole time;
each answer's status, error code and `X-Served-By` (the replica) is recorded.

HAProxy comes with Debian's `haproxy` package; without it these tests fail rather than skip.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from processes import free_port
from tiny_models import INFER_BODY, write_tiny_model

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "deploy" / "local" / "replicas.py"
sys.path.insert(0, str(SCRIPT.parent))
from replicas import HaproxyAdmin, session_members  # noqa: E402

SERVEWELL = str(Path(sys.executable).with_name("servewell"))
CLIENTS = 4
#: Pause between a client's requests: a steady ~150 req/s in all, which leaves CPU for restarts.
PAUSE_S = 0.02


@dataclass(slots=True, frozen=True)
class Answer:
    """One request through HAProxy."""

    sent_at: float
    done_at: float
    status: int
    code: str | None
    served_by: str | None


class SteadyLoad:
    """Closed-loop client threads posting to the tiny model through HAProxy until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.post("/v2/models/tiny/infer", json=INFER_BODY)
                    code = None
                    if response.status_code != 200:
                        try:
                            code = response.json()["code"]  # OIP error: {"error": message, "code"}
                        except (ValueError, KeyError, TypeError):
                            code = f"unparsed:{response.text[:80]!r}"
                    elif response.json()["outputs"][0]["data"] != [6.0]:
                        code = "wrong_answer"
                    self.answers.append(
                        Answer(sent, time.monotonic(), response.status_code, code, response.headers.get("x-served-by"))
                    )
                except httpx.HTTPError as exc:
                    self.answers.append(Answer(sent, time.monotonic(), 0, type(exc).__name__, None))
                time.sleep(PAUSE_S)

    def statuses(self, since: float = 0.0) -> Counter:
        """Status codes (with the error code when not 200) of the requests sent after `since`."""
        return Counter(
            a.status if a.code is None else f"{a.status} {a.code}" for a in self.answers if a.sent_at >= since
        )


class Replicas:
    """The supervisor (`replicas.py up`) as a child process, and views of its state."""

    def __init__(self, state_dir: Path, repository: Path) -> None:
        self.state_dir = state_dir
        self.repository = repository
        self.port = free_port()
        ports = [free_port() for _ in range(2)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir.parent / "supervisor.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "up",
                "--port",
                str(self.port),
                "--replica-ports",
                ",".join(map(str, ports)),
                "--servewell",
                SERVEWELL,
                "--state-dir",
                str(state_dir),
                "--",
                "--model-repository",
                str(repository),
                "--log-format",
                "json",
                # Model files change under these replicas in a test (to make the next load slow): they
                # must not pick the change up live (hot reload), only when a replica restarts.
                "--config-poll-s",
                "0",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.sessions: set[int] = set()  # every replica pid seen (each is its session's id)

    def state(self) -> dict:
        doc = json.loads((self.state_dir / "state.json").read_text())
        self.sessions.update(r["pid"] for r in doc["replicas"] if r["pid"])
        return doc

    def admin(self) -> HaproxyAdmin:
        return HaproxyAdmin(Path(self.state()["haproxy"]["admin_socket"]))

    def haproxy_status(self) -> dict[str, str]:
        """HAProxy's view of each replica: UP, DOWN, DRAIN, MAINT..."""
        return {name: row["status"] for name, row in self.admin().servers().items()}

    def replica(self, name: str) -> dict:
        return next(r for r in self.state()["replicas"] if r["name"] == name)

    def wait(self, condition, timeout_s: float, what: str) -> float:
        """Poll `condition` until true; the monotonic time it became true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the supervisor exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if condition():
                    return time.monotonic()
            except (OSError, ValueError, KeyError, StopIteration, httpx.HTTPError):
                pass  # state file being replaced, socket not there yet
            time.sleep(0.1)
        raise TimeoutError(f"{what}: not within {timeout_s:g} s\n{self.log()}")

    def wait_all_up(self, timeout_s: float = 120) -> None:
        self.wait(lambda: set(self.haproxy_status().values()) == {"UP"}, timeout_s, "every replica UP in HAProxy")

    def replaced(self, name: str, old_pid: int, timeout_s: float = 120) -> float:
        """Wait until replica `name` runs as a new process that HAProxy sees UP; when that happened."""
        return self.wait(
            lambda: self.replica(name)["pid"] not in (None, old_pid) and self.haproxy_status()[name] == "UP",
            timeout_s,
            f"{name} back UP",
        )

    def log(self) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")[-3000:]
        for replica in self.state_dir.glob("r*.log"):
            text += f"\n--- {replica.name}\n" + replica.read_text(errors="replace")[-1500:]
        return text

    def down(self) -> int:
        """`replicas.py down`: stops the supervisor, which stops everything; its exit status."""
        if self.proc.poll() is None:
            subprocess.run(
                [sys.executable, str(SCRIPT), "down", "--state-dir", str(self.state_dir)], check=True, timeout=90
            )
        code = self.proc.wait(30)
        self._log.close()
        return code


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("haproxy") is None:
        pytest.fail(
            "haproxy is not installed: .ci/run installs it (Debian package `haproxy`); "
            "locally: sudo apt-get install haproxy"
        )
    base = tmp_path_factory.mktemp("replicas")
    write_tiny_model(base / "repo")
    fleet = Replicas(base / "state", base / "repo")
    try:
        fleet.wait_all_up()
        yield fleet
    finally:
        if fleet.proc.poll() is None:
            fleet.proc.send_signal(signal.SIGTERM)
            fleet.proc.wait(90)


def raw_request(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """One request with `path` sent exactly as written (httpx would resolve dot segments); status and JSON body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = b'{"max_wait_ms": 5}' if method == "PATCH" else b""
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        text = response.read()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, {"unparsed": text[:200].decode(errors="replace")}
    finally:
        connection.close()


#: Model control through the load balancer, spelled so that a rule matching the raw path misses it
#: while servewell (which percent-decodes the path once) routes it (issue 19.5).
DISGUISED_CONTROL = [
    ("POST", "/v2/repository/models/tiny/%75nload"),
    ("PATCH", "/%61dmin/models/tiny/batching"),
    ("POST", "/v2/repository/models/tiny%2Funload"),
    ("POST", "/v2%2Frepository%2Fmodels/tiny/unload"),
    ("PATCH", "/%41dmin/models/tiny/batching"),
    ("PATCH", "/x/../admin/models/tiny/batching"),
    ("PATCH", "/x/%2e%2e/admin/models/tiny/batching"),
    ("PATCH", "//admin/models/tiny/batching"),
    ("GET", "/admin/config"),
    ("GET", "/admin"),
    ("POST", "/v2/repository/models/tiny/unload"),
]


def test_model_control_through_haproxy_is_refused_however_its_path_is_encoded(replicas: Replicas):
    for method, path in DISGUISED_CONTROL:
        status, body = raw_request(replicas.port, method, path)
        assert status in (400, 403), (method, path, status, body)
        assert body["error"]["code"] in ("bad_request", "forbidden"), (method, path, body)
    # Nothing reached a replica: both still serve tiny with their original settings.
    for replica in replicas.state()["replicas"]:
        assert httpx.get(f"http://127.0.0.1:{replica['port']}/v2/models/tiny/ready").status_code == 200
    answer = httpx.post(replicas.url + "/v2/models/tiny/infer", json=INFER_BODY)
    assert answer.status_code == 200, answer.text
    # Ordinary paths with dots and escapes in a model name still pass through to servewell (its 404).
    status, body = raw_request(replicas.port, "GET", "/v2/models/no.such%2Dmodel")
    assert status == 404 and body["code"] == "not_found", body  # OIP shape: {"error": message, "code", ...}


def test_replicas_require_their_admin_token_and_the_console_shows_no_admin_data_through_haproxy(replicas: Replicas):
    state = replicas.state()
    token_file = Path(state["admin_token_file"])
    assert token_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    token = token_file.read_text().strip()
    assert len(token) >= 32
    port = state["replicas"][0]["port"]
    # At a replica's own port, from this machine: the token is required (no loopback trust).
    status, body = raw_request(port, "PATCH", "/admin/models/tiny/batching")
    assert status == 401 and body["error"]["code"] == "unauthorized", body
    status, body = raw_request(port, "PATCH", "/admin/models/tiny/batching", {"Authorization": f"Bearer {token}"})
    assert status == 200 and body["max_wait_ms"] == 5, body
    reset = httpx.patch(f"http://127.0.0.1:{port}/admin/models/tiny/batching", json={"max_wait_ms": None},
                        headers={"Authorization": f"Bearer {token}"})
    assert reset.status_code == 200 and reset.json()["max_wait_ms"] == 25.0
    # Through HAProxy: the console's state answers, without the recent requests or batching settings.
    console = httpx.get(replicas.url + "/console/api/state").json()
    assert console["server"]["admin"] is False and console["recent"] is None, console["server"]
    # The token works through HAProxy as anywhere (the console page sends it when given).
    with_token = httpx.get(replicas.url + "/console/api/state", headers={"Authorization": f"Bearer {token}"})
    assert with_token.json()["server"]["admin"] is True


def test_rolling_restart_by_sigterm_fails_no_request(replicas: Replicas):
    with SteadyLoad(replicas.url) as load:
        time.sleep(1.0)
        for name in ("r1", "r2"):
            old_pid = replicas.replica(name)["pid"]
            os.kill(old_pid, signal.SIGTERM)  # what the kubelet does; the supervisor restarts it
            replicas.replaced(name, old_pid)
        time.sleep(1.0)
    statuses = load.statuses()
    assert statuses[200] > 200, statuses
    assert set(statuses) == {200}, f"{statuses}\n{replicas.log()}"
    # Both replicas answered after their restart: the restarted ones are back in rotation.
    restarted = {a.served_by for a in load.answers[-100:]}
    assert restarted == {"r1", "r2"}, restarted


def test_kill_9_gives_only_retried_or_503_answers_then_full_service(replicas: Replicas):
    victim = replicas.replica("r1")["pid"]
    with SteadyLoad(replicas.url) as load:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        down_at = replicas.wait(lambda: replicas.haproxy_status()["r1"] != "UP", 10, "r1 out of rotation")
        time.sleep(2.0)  # r1 restarts meanwhile; r2 serves alone
        back_at = replicas.replaced("r1", victim)
        time.sleep(1.0)
    statuses = load.statuses()
    odd = [
        (round(a.sent_at - killed_at, 3), round(a.done_at - killed_at, 3), a.status, a.code, a.served_by)
        for a in load.answers
        if a.status != 200
    ]
    assert all(s == 200 or str(s).startswith("503 ") for s in statuses), f"{statuses}: {odd}"
    assert statuses[200] > 100, statuses
    # After HAProxy took r1 out: every request answered, by r2 until r1 was back.
    after = [a for a in load.answers if a.sent_at > down_at + 0.5]
    assert after and all(a.status == 200 for a in after), Counter((a.status, a.code) for a in after)
    # Until its replacement was UP (seen here within ~0.2 s of HAProxy), r2 alone answered.
    alone = [a for a in after if a.sent_at < back_at - 0.5]
    assert alone and {a.served_by for a in alone} == {"r2"}
    assert any(a.served_by == "r1" for a in after if a.sent_at > back_at)
    # The killed replica's worker processes were ended with it (by pid, by the supervisor).
    assert session_members(victim) == []


def test_replica_whose_model_is_loading_gets_no_traffic_until_ready(replicas: Replicas):
    repository = replicas.repository
    old_pid = replicas.replica("r2")["pid"]
    port = replicas.replica("r2")["port"]
    loading_seen = []  # times at which the new r2 was listening (live) but not ready
    # The next load of `tiny` takes 6 s more (the PyTorch variant, same inputs and outputs); r1 keeps
    # the ONNX one it has loaded.
    write_tiny_model(repository, runtime="pytorch", load_delay_s=6.0)
    try:
        with SteadyLoad(replicas.url) as load:
            time.sleep(1.0)
            os.kill(old_pid, signal.SIGTERM)

            def ready() -> bool:
                if replicas.replica("r2")["pid"] in (None, old_pid):
                    return False
                live = httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=2).status_code == 200
                is_ready = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200
                if live and not is_ready:
                    loading_seen.append(time.monotonic())
                return is_ready

            ready_at = replicas.wait(ready, 120, "r2 ready after a slow load")
            replicas.wait(lambda: replicas.haproxy_status()["r2"] == "UP", 30, "r2 UP")
            time.sleep(1.5)
    finally:
        write_tiny_model(repository)
    # The window was real: r2 listened and said "not ready" for seconds, under load.
    assert loading_seen and loading_seen[-1] - loading_seen[0] > 3.0, loading_seen
    statuses = load.statuses()
    # A request routed to the loading replica would have been answered 503 model_not_ready.
    assert set(statuses) == {200}, f"{statuses}\n{replicas.log()}"
    during = [a for a in load.answers if loading_seen[0] <= a.sent_at and a.done_at <= loading_seen[-1]]
    assert during and {a.served_by for a in during} == {"r1"}
    assert any(a.served_by == "r2" for a in load.answers if a.sent_at > ready_at)


def test_supervisor_rolling_restart_drains_through_haproxy(replicas: Replicas):
    before = {name: replicas.replica(name)["pid"] for name in ("r1", "r2")}
    with SteadyLoad(replicas.url) as load:
        time.sleep(1.0)
        subprocess.run(
            [sys.executable, str(SCRIPT), "restart", "--state-dir", str(replicas.state_dir)], check=True, timeout=10
        )
        for name, pid in before.items():
            replicas.replaced(name, pid)
        replicas.wait(lambda: "rolling restart done" in replicas.log(), 60, "rolling restart done")
        time.sleep(1.0)
    statuses = load.statuses()
    assert set(statuses) == {200}, f"{statuses}\n{replicas.log()}"
    assert statuses[200] > 200


def test_down_stops_every_process_by_pid(replicas: Replicas):
    replicas.state()
    haproxy_pid = replicas.state()["haproxy"]["pid"]
    assert replicas.down() == 0
    assert all(session_members(sid) == [] for sid in replicas.sessions), replicas.sessions
    assert not Path(f"/proc/{haproxy_pid}").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(replicas.url + "/v2/health/live", timeout=2)
