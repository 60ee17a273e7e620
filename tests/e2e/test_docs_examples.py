"""Every shell and Python example of the Getting-started and how-to pages runs, as a reader would run
it, against a real server (`tests/support/doc_examples.py` says how a block is marked and run).

One test per page: its blocks run in order in one working directory (files a block writes are there
for the next), its servers are started by its own `<!-- server -->` blocks and stopped by pid when the
page is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from doc_examples import BLOCK_TIMEOUT_S, PYTHON, Block, blocks, example_pages, with_ports
from processes import free_port
from waiting import eventually

SERVER_READY_TIMEOUT_S = 180.0

PAGES = [page for page in example_pages() if any(block.runnable for block in blocks(page))]


class PageRun:
    """One page's working directory, ports, environment and background servers."""

    def __init__(self, work: Path, cache: Path) -> None:
        self.work = work
        self.http_port, self.grpc_port = free_port(), free_port()
        venv_bin = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    "SERVEWELL_PORT": str(self.http_port), "SERVEWELL_GRPC_PORT": str(self.grpc_port),
                    "SERVEWELL_CACHE_DIR": str(cache),
                    # As the e2e servers: no load balancer needs the shutdown delay; one ingress process.
                    "SERVEWELL_SHUTDOWN_DELAY_S": "0", "SERVEWELL_INGRESS_PROCESSES": "1",
                    "PYTHONUNBUFFERED": "1"}
        self.servers: list[tuple[subprocess.Popen[bytes], Path]] = []

    def text(self, block: Block) -> str:
        return with_ports(block.text, self.http_port, self.grpc_port)

    def write_file(self, block: Block) -> None:
        target = self.work / block.arg
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.text(block))

    def command(self, block: Block, index: int) -> list[str]:
        if block.lang in PYTHON:
            script = self.work / f".block-{index}.py"
            script.write_text(self.text(block))
            return [sys.executable, str(script)]
        return ["bash", "-euo", "pipefail", "-c", self.text(block)]

    def run(self, block: Block, index: int) -> None:
        try:
            done = subprocess.run(self.command(block, index), cwd=self.work, env=self.env, capture_output=True,
                                  timeout=BLOCK_TIMEOUT_S, text=True)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S:g} s{self.server_logs()}")
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{output[-3000:]}{self.server_logs()}"
        if block.mark == "expect":
            assert block.arg in output, f"{block.where}: {block.arg!r} not in its output:\n{output[-3000:]}"

    def start_server(self, block: Block, index: int) -> None:
        log = self.work / f".server-{index}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.command(block, index), cwd=self.work, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append((proc, log))
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{block.where}: the server exited {proc.returncode}:\n"
                                     f"{log.read_text(errors='replace')[-3000:]}")
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        eventually(ready, SERVER_READY_TIMEOUT_S,
                   lambda: f"{block.where}: not ready:\n{log.read_text(errors='replace')[-3000:]}")

    def server_logs(self) -> str:
        return "".join(f"\n--- server log {log.name} ---\n{log.read_text(errors='replace')[-2000:]}"
                       for _, log in self.servers)

    def stop(self) -> None:
        """SIGTERM to each server's process group (the shell and servewell under it), by its id."""
        for proc, _ in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(page.parents[1])))
def test_every_example_of_the_page_runs(page: Path, tmp_path: Path, servewell_cache: Path) -> None:
    run = PageRun(tmp_path, servewell_cache)
    try:
        for index, block in enumerate(blocks(page)):
            if not block.runnable:
                continue
            if block.mark == "file":
                run.write_file(block)
            elif block.mark == "server":
                run.start_server(block, index)
            else:
                run.run(block, index)
    finally:
        run.stop()
