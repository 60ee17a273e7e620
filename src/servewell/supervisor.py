"""`servewell serve` as a process tree: this process supervises one engine and N ingress processes.

It binds the public HTTP socket once and hands it to every ingress (one accept queue, which
outlives an ingress restart), writes the settings to a private run directory, starts the children,
watches them through pidfds (never blocking its loop) and restarts one that dies, with a backoff.

Contract with the children (`process_tree` builds their command lines, `child_process` holds what they share):

- engine: `python -m servewell.engine_main RUN`; ingress i: `python -m servewell.ingress_main RUN i FD`,
  FD being the inherited listening socket. Same interpreter and environment, stdout and stderr
  inherited (one log stream), stdin /dev/null, each in a process group of its own (a signal to the
  supervisor's group, from Ctrl-C, systemd or `docker stop`, reaches the supervisor alone, which
  translates it), killed by the kernel when the supervisor dies (PR_SET_PDEATHSIG, armed before exec).
- RUN/settings.pickle holds `(ServerConfig, ConfigSource)`; the engine creates RUN/engine-door.sock
  (envelopes and control operations: its only socket). RUN/restarts.json (`read_restart_counts`),
  rewritten at every restart, holds the restarts per role (`{"engine": 0, "ingress": 2}`), for the
  engine's metrics. RUN is removed at every exit of the supervisor; the run directories of
  supervisors killed with kill -9 are removed by the next start.
- A child that exits with status 2 (`FATAL_EXIT_CODE`: its configuration can never work) is not
  restarted: the supervisor shuts everything down and exits 2, as the single-process server does.

Signals: SIGINT or SIGTERM starts the shutdown: SIGUSR1 to the engine (readiness false, keeps
serving) and the same signal to every ingress at the same moment (SIGTERM: each answers not ready
for shutdown_delay_s, closes its listener, drains; SIGINT, as from Ctrl-C: the same without the
delay, as the single-process server does); once every ingress has exited (or was killed after
[shutdown_delay_s +] shutdown_timeout_s + `INGRESS_EXIT_GRACE_S`) the supervisor closes its copy of
the listening socket and sends the engine SIGTERM (drain, stop the workers; killed after
shutdown_timeout_s + `ENGINE_EXIT_GRACE_S`). Nothing restarts once the shutdown began. A second
SIGINT or SIGTERM kills every child at once. SIGHUP is passed to the engine (configuration reload).
Exit status 0 after a shutdown, 1 when the port cannot be bound, 2 after a fatal child exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from servewell.child_process import write_settings
from servewell.config.server import ConfigSource, ServerConfig
from servewell.cpu_limit import affinity_cpus, cpu_quota
from servewell.engine_standby import STANDBY_AFTER_S, StandbyEngine
from servewell.process_tree import (
    DEFAULT_MAX_INGRESS_PROCESSES,
    ENGINE_MODULE_ARGV,
    INGRESS_MODULE_ARGV,
    ListenError,
    RestartBackoff,
    bind_listener,
    check_port_free,
    death_signal_preexec,
    engine_command,
    ingress_command,
    ingress_process_count,
    make_run_dir,
    remove_run_dir,
    remove_stale_run_dirs,
    write_restart_counts,
)

log = logging.getLogger("servewell.supervisor")

ENGINE = "engine"
INGRESS = "ingress"
#: A child exiting with this status says its configuration can never work: it is not restarted.
FATAL_EXIT_CODE = 2
#: Seconds an ingress gets past shutdown_delay_s + shutdown_timeout_s before it is killed: uvicorn's
#: own margin behind the drain (2 s) and the span flush (1 s), with room to spare.
INGRESS_EXIT_GRACE_S = 5.0
#: Seconds the engine gets past shutdown_timeout_s after its SIGTERM: the workers' stop (2 s) and
#: the span flush (1 s), with room to spare.
ENGINE_EXIT_GRACE_S = 5.0
#: Seconds to wait for a child to be reaped after SIGKILL.
_KILLED_WAIT_S = 5.0

# The `event` field of the supervisor's log lines (stable: alerts and tests match on them).
EVENT_STARTED = "child_started"
EVENT_EXITED = "child_exited"
EVENT_RESTART_SCHEDULED = "child_restart_scheduled"
EVENT_START_FAILED = "child_start_failed"
EVENT_FATAL = "child_fatal"
EVENT_KILLED = "child_killed"
EVENT_LISTEN_FAILED = "listen_failed"
EVENT_SHUTDOWN_BEGUN = "shutdown_begun"
EVENT_SHUTDOWN_FORCED = "shutdown_forced"
EVENT_SHUTDOWN_FINISHED = "shutdown_finished"
EVENT_SIGNAL_FORWARDED = "signal_forwarded"
EVENT_STANDBY_STARTED = "standby_started"


@dataclass(eq=False)
class _Child:
    role: str
    index: int
    command: list[str]
    backoff: RestartBackoff
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    exited: asyncio.Future[int] | None = None
    restart: asyncio.TimerHandle | None = None
    pidfd: int | None = None
    facts: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.role if self.role == ENGINE else f"{self.role}[{self.index}]"

    @property
    def running(self) -> bool:
        """Started and not yet reaped (its pid is still its own)."""
        return self.exited is not None and not self.exited.done()

    def signal(self, sig: signal.Signals) -> bool:
        if self.process is None or not self.running:
            return False
        self.process.send_signal(sig)
        return True


#: After a second SIGTERM/SIGINT, how long the children get to answer what waits and exit.
FORCED_EXIT_GRACE_S = 3.0


class Supervisor:
    """Runs one engine and `ingress_processes` ingress processes until a signal says stop (see the
    module doc). `engine_argv` and `ingress_argv` (what follows the interpreter, before RUN) can be
    replaced, e.g. by stand-ins in tests; `run_parent` is where the run directory is made."""

    def __init__(self, settings: ServerConfig, source: ConfigSource, *, ingress_processes: int,
                 engine_argv: Sequence[str] = ENGINE_MODULE_ARGV, ingress_argv: Sequence[str] = INGRESS_MODULE_ARGV,
                 python: str = sys.executable, run_parent: Path | None = None,
                 backoff: Callable[[], RestartBackoff] = RestartBackoff,
                 standby_after_s: float = STANDBY_AFTER_S) -> None:
        if ingress_processes < 1:
            raise ValueError("a supervisor needs at least one ingress process")
        self._settings = settings
        self._source = source
        self._ingress_processes = ingress_processes
        self._engine_argv = tuple(engine_argv)
        self._ingress_argv = tuple(ingress_argv)
        self._python = python
        self._run_parent = run_parent
        self._backoff = backoff
        self._children: list[_Child] = []
        self._restarts = {ENGINE: 0, INGRESS: 0}
        self._stopping = False
        self._exit_code = 0
        self._listener: socket.socket | None = None
        self._finished: asyncio.Future[int] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._run_dir: Path | None = None
        self._cleanups: set[asyncio.Future[int]] = set()  # segment removals running on a thread
        self._standby: StandbyEngine | None = None  # --standby-engine: engine_standby.py
        self._standby_after_s = standby_after_s
        self._standby_timer: asyncio.TimerHandle | None = None

    def restart_counts(self) -> dict[str, int]:
        """Restarts so far per role (`engine`, `ingress`), for the metrics."""
        return dict(self._restarts)

    def pids(self) -> dict[str, int | None]:
        """Each child's pid by name (`engine`, `ingress[0]`, ...); None while one waits to restart."""
        return {c.name: c.process.pid if c.process is not None and c.running else None for c in self._children}

    async def serve(self) -> int:
        """Bind, start the children, supervise them until the shutdown has finished; the exit status."""
        loop = asyncio.get_running_loop()
        stale = remove_stale_run_dirs(self._run_parent)
        if stale:
            log.info("removed %d run directories left by supervisors that no longer run", len(stale))
        settings = self._settings
        try:
            listener = bind_listener(settings.host, settings.port)
        except ListenError as exc:
            log.error("%s", exc.strerror, extra={"event": EVENT_LISTEN_FAILED, "host": settings.host,
                                                 "port": settings.port})
            return 1
        if settings.grpc_port:  # every ingress binds it with SO_REUSEPORT: a server already there must fail this one
            try:
                check_port_free(settings.host, settings.grpc_port)
            except ListenError as exc:
                listener.close()
                log.error("%s", exc.strerror, extra={"event": EVENT_LISTEN_FAILED, "host": settings.host,
                                                     "port": settings.grpc_port})
                return 1
        self._listener = listener
        try:
            run_dir = make_run_dir(self._run_parent)
        except OSError:
            listener.close()
            raise
        self._run_dir = run_dir
        self._finished = loop.create_future()
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        try:
            write_settings(run_dir, settings, self._source)
            self._children = [_Child(ENGINE, 0, engine_command(run_dir, self._engine_argv, self._python),
                                     self._backoff())]
            self._children += [
                _Child(INGRESS, i, ingress_command(run_dir, i, listener.fileno(), self._ingress_argv, self._python),
                       self._backoff(), pass_fds=(listener.fileno(),))
                for i in range(self._ingress_processes)]
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_stop_signal, sig)
            loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
            for child in self._children:
                self._start(child)
            if settings.standby_engine:
                self._standby = StandbyEngine(self._children[0].command)
                self._schedule_standby()
            log.info("servewell listening on http://%s:%d (an engine and %d ingress processes)", settings.host,
                     settings.port, self._ingress_processes)
            return await self._finished
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            self._leave_nothing_behind(loop, run_dir)

    def _start(self, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        child.restart = None
        process = subprocess.Popen(child.command, stdin=subprocess.DEVNULL, pass_fds=child.pass_fds,
                                   preexec_fn=death_signal_preexec(os.getpid()), process_group=0)
        child.process = process
        child.started_at = loop.time()
        child.exited = loop.create_future()
        child.facts = {"role": child.role, "index": child.index, "pid": process.pid}
        self._watch(child, process, child.exited)
        log.info("%s started (pid %d)", child.name, process.pid, extra={"event": EVENT_STARTED, **child.facts})

    def _watch(self, child: _Child, process: subprocess.Popen[bytes], exited: asyncio.Future[int]) -> None:
        loop = asyncio.get_running_loop()

        def reaped() -> None:
            if child.pidfd is not None:
                loop.remove_reader(child.pidfd)
                os.close(child.pidfd)
                child.pidfd = None
            process.wait()  # it has exited: this reaps it without waiting
            self._on_exit(child, process, exited)

        try:
            child.pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): a thread waits instead
            waiter = loop.run_in_executor(None, process.wait)
            waiter.add_done_callback(lambda _: reaped())
            return
        loop.add_reader(child.pidfd, reaped)

    def _on_exit(self, child: _Child, process: subprocess.Popen[bytes], exited: asyncio.Future[int]) -> None:
        code = process.returncode
        ran_s = asyncio.get_running_loop().time() - child.started_at
        how = {"signal": signal.Signals(-code).name} if code < 0 else {"exit_code": code}
        facts = {"event": EVENT_EXITED, **child.facts, **how, "ran_s": round(ran_s, 3), "expected": self._stopping}
        if not exited.done():
            exited.set_result(code)
        said = f"{how['signal']}" if code < 0 else f"exit code {code}"
        if self._stopping:
            log.info("%s (pid %d) exited (%s)", child.name, process.pid, said, extra=facts)
            _remove_stale_segments()  # what the dead process had in /dev/shm
            return
        log.warning("%s (pid %d) exited unexpectedly (%s) after %.1f s", child.name, process.pid, said, ran_s,
                    extra=facts)
        if code == FATAL_EXIT_CODE:
            log.error("%s says its configuration can never work (exit code %d): not restarted; stopping",
                      child.name, code, extra={"event": EVENT_FATAL, **child.facts})
            self._begin_stop(f"{child.name} exited with {code}", FATAL_EXIT_CODE, signal.SIGTERM)
            return
        if not (child.role == ENGINE and self._promote_standby(child, ran_s)):
            self._schedule_restart(child, child.backoff.delay_after(ran_s))
        # What the dead process had in /dev/shm goes after its successor is on its way, and off the
        # loop: the first time, this imports numpy, which held a killed engine's restart back by
        # 2 s on a busy 2-core machine (issue 45 H15).
        cleaning = asyncio.get_running_loop().run_in_executor(None, _remove_stale_segments)
        self._cleanups.add(cleaning)
        cleaning.add_done_callback(self._cleanups.discard)

    def _schedule_standby(self) -> None:
        """Start a standby engine `standby_after_s` from now (not while an engine starts)."""
        if self._standby is None or self._stopping:
            return
        if self._standby_timer is not None:
            self._standby_timer.cancel()
        self._standby_timer = asyncio.get_running_loop().call_later(self._standby_after_s, self._start_standby)

    def _start_standby(self) -> None:
        self._standby_timer = None
        if self._standby is None or self._stopping or self._standby.pid is not None:
            return
        try:
            pid = self._standby.start()
        except OSError as exc:
            log.error("the standby engine could not be started: %s", exc, extra={"event": EVENT_START_FAILED,
                                                                                 "role": "standby"})
            return
        log.info("standby engine started (pid %d): it takes over when the engine dies", pid,
                 extra={"event": EVENT_STANDBY_STARTED, "role": "standby", "pid": pid})

    def _promote_standby(self, engine: _Child, ran_s: float) -> bool:
        """The engine died: its standby, if one waits, takes over now (instead of a new engine's start,
        imports included). Whether one did."""
        if self._standby is None:
            return False
        process = self._standby.promote()
        if process is None:
            return False
        engine.backoff.delay_after(ran_s)  # a crash loop still backs off once no standby is left
        self._restarts[ENGINE] += 1
        if self._run_dir is not None:
            write_restart_counts(self._run_dir, self._restarts)
        loop = asyncio.get_running_loop()
        engine.restart = None
        engine.process = process
        engine.started_at = loop.time()
        engine.exited = loop.create_future()
        engine.facts = {"role": engine.role, "index": engine.index, "pid": process.pid, "standby": True}
        self._watch(engine, process, engine.exited)
        log.info("engine started (pid %d): the standby took over", process.pid,
                 extra={"event": EVENT_STARTED, **engine.facts})
        self._schedule_standby()
        return True

    def _schedule_restart(self, child: _Child, delay_s: float) -> None:
        log.warning("restarting %s in %.1f s", child.name, delay_s,
                    extra={"event": EVENT_RESTART_SCHEDULED, "role": child.role, "index": child.index,
                           "delay_s": delay_s})
        loop = asyncio.get_running_loop()
        if delay_s <= 0:
            child.restart = None
            self._restart(child)  # now: not even one more turn of the loop
            return
        child.restart = loop.call_later(delay_s, self._restart, child)

    def _restart(self, child: _Child) -> None:
        if self._stopping:
            return
        self._restarts[child.role] += 1
        if self._run_dir is not None:
            write_restart_counts(self._run_dir, self._restarts)
        try:
            self._start(child)
        except OSError as exc:  # e.g. out of processes or memory: try again later
            log.error("%s could not be started: %s", child.name, exc,
                      extra={"event": EVENT_START_FAILED, "role": child.role, "index": child.index})
            self._schedule_restart(child, child.backoff.delay_after(0.0))
            return
        if child.role == ENGINE:
            self._schedule_standby()

    def _on_hangup(self) -> None:
        engine = self._children[0]
        if engine.signal(signal.SIGHUP):
            log.info("SIGHUP passed to the engine", extra={"event": EVENT_SIGNAL_FORWARDED, "signal": "SIGHUP"})

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if not self._stopping:
            self._begin_stop(sig.name, 0, sig)
            return
        log.warning("%s again: stopping now", sig.name, extra={"event": EVENT_SHUTDOWN_FORCED, "signal": sig.name})
        # Passed on, so every request still waiting is answered 503 shutting_down (each ingress and
        # the engine cut their drain short: a second signal there, two for an engine not yet told);
        # what has not exited after FORCED_EXIT_GRACE_S is killed.
        engine, ingresses = self._children[0], self._children[1:]
        for ingress in ingresses:
            ingress.signal(sig)
        loop = asyncio.get_running_loop()
        engine.signal(signal.SIGTERM)
        loop.call_later(0.05, engine.signal, signal.SIGTERM)  # apart: two pending signals would merge into one
        loop.call_later(FORCED_EXIT_GRACE_S, self._kill_all)

    def _kill_all(self) -> None:
        for child in self._children:
            if child.signal(signal.SIGKILL):
                log.warning("%s (pid %s) killed", child.name, child.facts.get("pid"),
                            extra={"event": EVENT_KILLED, **child.facts})

    def _begin_stop(self, why: str, exit_code: int, ingress_signal: signal.Signals) -> None:
        self._stopping = True
        self._exit_code = exit_code
        if self._standby_timer is not None:
            self._standby_timer.cancel()
            self._standby_timer = None
        if self._standby is not None:
            self._standby.release()  # it exits on its own; `_leave_nothing_behind` reaps it
        for child in self._children:
            if child.restart is not None:
                child.restart.cancel()
                child.restart = None
        s = self._settings
        delay_s = s.shutdown_delay_s if ingress_signal == signal.SIGTERM else 0.0
        log.info("%s: shutting down; ingress processes turn not ready, serve %.1f s more, then drain for at most "
                 "%.1f s; the engine stops last", why, delay_s, s.shutdown_timeout_s,
                 extra={"event": EVENT_SHUTDOWN_BEGUN, "reason": why})
        self._stop_task = asyncio.get_running_loop().create_task(self._stop(ingress_signal, delay_s))
        self._stop_task.add_done_callback(self._stop_done)

    def _stop_done(self, task: asyncio.Task[None]) -> None:
        # A shutdown that failed must still end `serve` (whose `finally` then kills what is left).
        failure = None if task.cancelled() else task.exception()
        if failure is not None and self._finished is not None and not self._finished.done():
            self._finished.set_exception(failure)

    async def _stop(self, ingress_signal: signal.Signals, delay_s: float) -> None:
        began = time.monotonic()
        engine, ingresses = self._children[0], self._children[1:]
        engine.signal(signal.SIGUSR1)
        for ingress in ingresses:
            ingress.signal(ingress_signal)
        if self._listener is not None:
            # Nothing restarts from now on: the ingress processes' copies are the socket's last, so
            # it stops listening when they close theirs after the delay (new connections are then
            # refused at once, as by a single process); a copy kept here would leave it listening
            # with nobody accepting until every ingress had drained, and reset what queued meanwhile.
            self._listener.close()
            self._listener = None
        s = self._settings
        await _wait_or_kill(ingresses, delay_s + s.shutdown_timeout_s + INGRESS_EXIT_GRACE_S)
        engine.signal(signal.SIGTERM)
        await _wait_or_kill([engine], s.shutdown_timeout_s + ENGINE_EXIT_GRACE_S)
        log.info("shutdown finished %.1f s after it began", time.monotonic() - began,
                 extra={"event": EVENT_SHUTDOWN_FINISHED, "exit_code": self._exit_code})
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(self._exit_code)

    def _leave_nothing_behind(self, loop: asyncio.AbstractEventLoop, run_dir: Path) -> None:
        """Every exit, errors included: no child, socket, segment or run directory stays."""
        if self._standby_timer is not None:
            self._standby_timer.cancel()
        if self._standby is not None:
            self._standby.end()
        for child in self._children:
            if child.restart is not None:
                child.restart.cancel()
            if child.process is not None and child.process.returncode is None:
                child.process.kill()
                child.process.wait()
            if child.pidfd is not None:
                loop.remove_reader(child.pidfd)
                os.close(child.pidfd)
                child.pidfd = None
        if self._stop_task is not None and not self._stop_task.done():
            self._stop_task.cancel()
        if self._listener is not None:
            self._listener.close()
        left = _remove_stale_segments()
        if left:
            log.info("removed %d shared-memory segments left by processes that exited", left)
        remove_run_dir(run_dir)


async def _wait_or_kill(children: list[_Child], timeout_s: float) -> None:
    """Wait up to `timeout_s` for `children` to exit; kill (SIGKILL) those that did not."""
    waiting = [c.exited for c in children if c.running and c.exited is not None]
    if waiting:
        await asyncio.wait(waiting, timeout=timeout_s)
    late = [c for c in children if c.running]
    for child in late:
        log.warning("%s (pid %s) did not exit within %.1f s: killed", child.name, child.facts.get("pid"), timeout_s,
                    extra={"event": EVENT_KILLED, **child.facts})
        child.signal(signal.SIGKILL)
    killed = [c.exited for c in late if c.exited is not None]
    if killed:
        await asyncio.wait(killed, timeout=_KILLED_WAIT_S)


def _remove_stale_segments() -> int:
    from servewell.workers.shm import remove_stale_segments  # numpy: only when a child has exited

    return remove_stale_segments()


def run(settings: ServerConfig, source: ConfigSource) -> int:
    """`servewell serve` with ingress processes: supervise until stopped; the exit status."""
    count = ingress_process_count(settings.ingress_processes)
    if settings.ingress_processes is None:
        quota = cpu_quota()
        log.info("%d ingress processes by default: one per usable CPU (%d in this process's affinity mask, CPU "
                 "limit %s), at most %d", count, affinity_cpus(),
                 "none" if quota is None else f"{quota:g} from its control group", DEFAULT_MAX_INGRESS_PROCESSES)
    return asyncio.run(Supervisor(settings, source, ingress_processes=count).serve())
