"""The package a user installs: `python -m build` makes a wheel and an sdist, the wheel installs into a
fresh virtual environment with pip alone (no checkout, no `make`), and the installed `servewell serve`
builds and serves the built-in model, run from outside the checkout.

Marked serial: installing torch unpacks about a gigabyte, which on a 2-core machine shared with the
parallel part of the suite took 5 minutes (1 minute 15 s of CPU) instead of about 2.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

import servewell
from processes import ChildProcess, free_port

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
#: Where machines of this kind keep the CPU build of torch (as the Makefile uses it).
WHEELS = Path("/opt/wheels")
#: What serving the built-in model needs: onnxruntime to serve it, torch and scikit-learn to build it.
EXTRAS = "onnx,examples"
#: Package data the server needs at run time (the console's page and scripts, the example images).
PACKAGE_DATA = ("servewell/api/console/index.html", "servewell/api/console/console.js",
                "servewell/api/console/uPlot.iife.min.js", "servewell/api/console/swagger-ui-bundle.js",
                "servewell/examples/images/digit-3-200px.jpg")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would put the checkout or the project's venv on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    return {**env, **extra}


def run(args: list[str], cwd: Path, timeout_s: float, **env: str) -> str:
    done = subprocess.run(args, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


def test_the_built_wheel_installs_in_a_fresh_environment_and_serves_the_built_in_model(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], tmp_path, 600)
    wheels = list(dist.glob("servewell-*.whl"))
    sdists = list(dist.glob("servewell-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    wheel = wheels[0]
    assert wheel.name.startswith(f"servewell-{servewell.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [name for name in PACKAGE_DATA if name not in names], f"missing from the wheel: {PACKAGE_DATA}"

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)  # no --system-site-packages: a fresh one
    find_links = ["--find-links", str(WHEELS)] if WHEELS.is_dir() else []
    started = time.monotonic()
    # --no-compile: byte-compiling all of torch is not what this checks (100 s -> 84 s of the suite).
    run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-compile", *find_links, f"{wheel}[{EXTRAS}]"],
        tmp_path, 900)
    install_s = time.monotonic() - started
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 1e6:.2f} MB; pip install [{EXTRAS}] took {install_s:.0f} s")

    # From outside the checkout: the servewell that answers is the installed one.
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run([str(venv / "bin" / "python"), "-c", "import servewell; print(servewell.__file__)"], work, 60)
    assert where.strip().startswith(str(venv)) and str(ROOT) not in where, where
    version = run([str(venv / "bin" / "servewell"), "--version"], work, 60)
    assert version.strip() == f"servewell {servewell.__version__}", version
    # The fleet planner ships in the wheel but is usable only with its own extra, which this install lacks:
    # `servewell plan` names the extra and exits 2.
    assert "servewell_plan/command.py" in names
    refused = subprocess.run([str(venv / "bin" / "servewell"), "plan", "curve.json", "--slo-p99-ms", "100", "--rps",
                              "10"], cwd=work, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "pip install 'servewell[plan]'" in refused.stderr, refused.stderr

    port, grpc_port = free_port(), free_port()
    server = ChildProcess([str(venv / "bin" / "servewell"), "serve", "--port", str(port), "--grpc-port",
                           str(grpc_port), "--cache-dir", str(tmp_path / "cache")], tmp_path / "server.log",
                          clean_env(SERVEWELL_SHUTDOWN_DELAY_S="0", SERVEWELL_INGRESS_PROCESSES="1"))
    try:
        server.wait_http_ok(f"http://127.0.0.1:{port}/v2/health/ready", 300)
        images = Path(run([str(venv / "bin" / "python"), "-c", "import pathlib, servewell.examples as e; "
                           "print(pathlib.Path(e.__file__).parent / 'images')"], work, 60).strip())
        assert images.is_relative_to(venv), images
        image = base64.b64encode((images / "digit-3-200px.jpg").read_bytes()).decode()
        answer = httpx.post(f"http://127.0.0.1:{port}/predict", json={"image_base64": image}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"]["label"] == "3", answer.text
        console = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)  # package data served from the wheel
        assert console.status_code == 200 and "<html" in console.text.lower()
    finally:
        assert server.stop() == 0, server.log()[-3000:]
