"""What the docs and the image promise, checked against the code that owns each fact, without a
container engine: the Dockerfile's install line brings every runtime (its extras resolved against
pyproject.toml), its command and the documented run commands are flags `servewell serve` accepts,
and the docs' Kubernetes table (docs/operations/shutdown.md) states the probe values, grace period and
ports of the manifests.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from servewell.cli import build_parser
from servewell.config.server import ServerConfig

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
DEPLOYMENT = ROOT / "deploy" / "kubernetes" / "base" / "deployment.yaml"
#: The pages that show `docker run` / `podman run` commands and the Kubernetes table.
DOC_PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "deploy" / "README.md")
SHUTDOWN_PAGE = ROOT / "docs" / "operations" / "shutdown.md"
#: The import each runtime needs in its worker, and the built-in digits model's build
#: (servewell.examples.digits: trained with scikit-learn, exported with torch to ONNX).
RUNTIME_PACKAGES = {"onnxruntime": "onnx", "torch": "torchscript, pytorch", "safetensors": "pytorch (.safetensors)",
                    "onnx": "built-in digits model (export)", "scikit-learn": "built-in digits model (training)"}


def dockerfile_lines() -> list[str]:
    """The Dockerfile with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


#: The image's install of servewell: the wheel it built from the checkout, with extras.
WHEEL_INSTALL = re.compile(r"pip install [^&]*?\"\$\(ls /dist/servewell-\*\.whl\)(?:\[([^\]]*)\])?\"")


def installed_extras() -> set[str]:
    """The extras of the `pip install "$(ls /dist/servewell-*.whl)[...]"` that installs servewell in the image."""
    for line in dockerfile_lines():
        match = WHEEL_INSTALL.search(line)
        if match:
            return {extra.strip() for extra in (match.group(1) or "").split(",") if extra.strip()}
    raise AssertionError("no `pip install \"$(ls /dist/servewell-*.whl)[...]\"` line in the Dockerfile")


def test_the_image_installs_the_wheel_it_builds_from_the_checkout():
    # The image is what a user's `pip install servewell-*.whl` gives: built from the copied sources
    # into /dist, then installed from there (not `pip install /src`, which would not prove the wheel).
    lines = dockerfile_lines()
    copies = " ".join(line for line in lines if line.startswith("COPY"))
    for needed in ("pyproject.toml", "README.md", "LICENSE", "src"):  # what building the wheel reads
        assert needed in copies, f"the Dockerfile does not copy {needed} for the wheel's build"
    build = next((line for line in lines if "pip wheel" in line), "")
    assert "--wheel-dir /dist /src" in build, build
    assert not any(re.search(r"pip install [^&]*\"?/src[\[\"\s]", line) for line in lines)


def resolve_extras(extras: set[str]) -> set[str]:
    """The distributions the core install and `extras` bring, following servewell[...] self-references."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    names = {Requirement(spec).name.lower() for spec in project["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        assert extra in optional, f"the Dockerfile installs extra {extra!r}, which pyproject.toml does not define"
        seen.add(extra)
        for spec in optional[extra]:
            requirement = Requirement(spec)
            if requirement.name == "servewell":
                todo.extend(sorted(requirement.extras - seen))
            else:
                names.add(requirement.name.lower())
    return names


def test_the_image_installs_every_runtime_and_what_the_built_in_model_needs():
    packages = resolve_extras(installed_extras())
    missing = {name: why for name, why in RUNTIME_PACKAGES.items() if name not in packages}
    assert not missing, f"the image would lack {missing} (extras installed: {sorted(installed_extras())})"


def test_the_image_keeps_the_cpu_torch_wheel():
    # torch is installed first, from the CPU index; the extras' `torch==2.13.0` is then already met.
    lines = dockerfile_lines()
    assert any("ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in line for line in lines)
    torch_pins = [spec for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                  ["optional-dependencies"]["torch"] if spec.startswith("torch")]
    assert any("torch==2.13.0" in line for line in lines) and "torch==2.13.0" in torch_pins


def image_command() -> list[str]:
    """The arguments of `servewell serve` in the image: ENTRYPOINT's after `serve`, then CMD."""
    exec_forms = {line.split()[0]: line.split(None, 1)[1] for line in dockerfile_lines()
                  if line.split()[0] in {"ENTRYPOINT", "CMD"}}
    entrypoint = yaml.safe_load(exec_forms["ENTRYPOINT"])
    assert entrypoint[-2:] == ["servewell", "serve"], entrypoint
    return list(yaml.safe_load(exec_forms["CMD"]))


def serve_args(argv: list[str]) -> Any:
    """argv parsed as `servewell serve` does; argparse exits (status 2) on a flag that does not exist."""
    return build_parser().parse_args(["serve", *argv])


def test_the_image_command_and_ports_are_what_the_manifests_expose():
    args = serve_args(image_command())
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    exposed = next(line for line in dockerfile_lines() if line.startswith("EXPOSE")).split()[1:]
    assert (args.port, args.grpc_port) == (ports["http"], ports["grpc"]) == tuple(int(p) for p in exposed)
    manifest_args = serve_args(container["args"])
    assert (manifest_args.port, manifest_args.grpc_port) == (ports["http"], ports["grpc"])


def documented_serve_commands() -> list[list[str]]:
    """The arguments after the image name of every `docker run`/`podman run` of the image in the docs."""
    commands = []
    for doc in (*DOC_PAGES, DOCKERFILE):
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for line in text.splitlines():
            line = line.lstrip("# ").split("  # ")[0]
            if not re.match(r"(docker|podman) (\S+ )*?run ", line):
                continue
            words = shlex.split(line)
            image = next(i for i, word in enumerate(words) if re.search(r"servewell:[\w.-]+$", word))
            commands.append(words[image + 1:])
    return commands


def test_every_documented_run_command_passes_flags_serve_accepts():
    commands = documented_serve_commands()
    assert len(commands) >= 4, commands
    for argv in commands:
        serve_args(argv)  # SystemExit(2) on an unknown flag


def test_documented_host_network_runs_do_not_take_the_default_grpc_port():
    # With --network host, every port servewell binds is the host's: 8001 may be taken there.
    for doc in DOC_PAGES:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for line in text.splitlines():
            if re.match(r"\s*podman (\S+ )*?run .*--network host", line):
                assert "--grpc-port" in line, f"{doc.name}: {line.strip()}"


def readme_kubernetes_table() -> dict[str, str]:
    """The docs' Kubernetes table (Signals and shutdown): setting -> its value and why, as one string."""
    text = SHUTDOWN_PAGE.read_text()
    section = text[text.index("**Kubernetes** (the values of"):]
    rows: dict[str, str] = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = " | ".join(cells[1:])
    return rows


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe", "readinessProbe"])
def test_readme_kubernetes_table_states_the_manifest_probes(probe):
    container = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]
    spec = container[probe]
    row = readme_kubernetes_table()[probe]
    assert f"GET {spec['httpGet']['path']}" in row, row
    assert f"period {spec['periodSeconds']} s" in row, row
    assert f"timeout {spec['timeoutSeconds']} s" in row, row
    assert f"failureThreshold {spec['failureThreshold']}" in row, row


def test_readme_kubernetes_table_states_the_manifest_drain_and_ports():
    pod = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    table = readme_kubernetes_table()
    assert numbers(table["terminationGracePeriodSeconds"])[0] == pod["terminationGracePeriodSeconds"]
    assert numbers(table["preStop"])[0] == container["lifecycle"]["preStop"]["sleep"]["seconds"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"`http` {ports['http']}" in table["ports"] and f"`grpc` {ports['grpc']}" in table["ports"]
    defaults = ServerConfig()
    assert f"listens on {defaults.port} and {defaults.grpc_port}" in table["ports"]


def test_readme_grace_period_arithmetic_uses_the_manifest_and_default_values():
    pod = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}  # secrets come by valueFrom
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    delay = ServerConfig().shutdown_delay_s
    timeout = float(env["SERVEWELL_SHUTDOWN_TIMEOUT_S"])
    row = readme_kubernetes_table()["terminationGracePeriodSeconds"]
    stated = f"preStop {pre_stop} + `shutdown_delay_s` {delay:g} + `SERVEWELL_SHUTDOWN_TIMEOUT_S` {timeout:g}"
    assert stated in row, row
    assert pre_stop + delay + timeout + 3 <= pod["terminationGracePeriodSeconds"]
