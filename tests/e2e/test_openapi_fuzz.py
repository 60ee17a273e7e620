"""schemathesis against our own /openapi.json, every check on: no 5xx, every status, header, content
type and body as documented, schema-invalid requests refused, schema-valid ones accepted where
a JSON schema can say what is valid. Once with generated model names (404s, and bodies checked
before the name), once with the servers' real models (the digits image model; an echo tensor
model; a model whose batching settings the PATCH fuzzing may change freely).

`make test` runs `fuzzing.API_EXAMPLES` examples per operation and phase; `make fuzz` many more.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fuzzing
from model_dirs import slow_model

#: Schema-valid requests that the server may still refuse, per operation, and why: what a JSON
#: schema cannot state. Everything else schema-valid must be accepted (2xx) or be a 404/409.
CONTENT_RULES = {
    # The base64 must decode to an image within the pixel limits, for a model that takes images.
    "/predict": ["400", "413", "422"],
    # Tensors must match the model's inputs (names, datatypes, shapes), encoded images must decode.
    "/v2/models/{name}/infer": ["400", "413", "422"],
    "/v2/models/{name}/versions/{version}/infer": ["400", "413", "422"],
    # Streams and the OpenAI API need a model that takes text (a text: section); infer_stream's tensors
    # must match the model's inputs as infer's do.
    **{f"/v2/models/{{name}}{version}/{route}": ["413", "422"]
       for version in ("", "/versions/{version}") for route in ("generate", "generate_stream", "infer_stream")},
    **{f"/v1/{route}": ["413", "422"] for route in ("completions", "chat/completions", "embeddings")},
    # A max_batch_size must be one warm-up proved; reserving an instance needs two.
    "/admin/models/{name}/batching": ["422"],
    # Weights must not all be 0.
    "/admin/models/{name}/rollout": ["422"],
}
ACCEPTED = ["2xx", "404", "409"]

CONFIG = """
workers = 1
seed = {seed}

[generation]
max-examples = {examples}

[checks]
positive_data_acceptance.expected-statuses = {accepted}
{operations}
"""


def config_file(path: Path, real: dict[str, str] | None) -> Path:
    """A schemathesis.toml: bounded examples, our content-rule exceptions, and (with `real`) path
    names fixed to real models per operation ('*': every other operation)."""
    sections = []
    for route, extra in CONTENT_RULES.items():
        sections.append(
            f'[[operations]]\ninclude-path = "{route}"\n'
            f"checks.positive_data_acceptance.expected-statuses = {ACCEPTED + extra}\n"
        )
    if real is not None:
        for route, name in real.items():
            if route != "*":
                sections.append(
                    f'[[operations]]\ninclude-path = "{route}"\nparameters = {{ "path.name" = "{name}" }}\n'
                )
        sections.append(f'[parameters]\n"path.name" = "{real["*"]}"\n"path.version" = "1"\n')
    text = CONFIG.format(
        seed=0 if not fuzzing.LONG else "",
        examples=fuzzing.API_EXAMPLES,
        accepted=ACCEPTED,
        operations="\n".join(sections),
    )
    if fuzzing.LONG:
        text = text.replace("seed = \n", "")
    path.write_text(textwrap.dedent(text))
    return path


def run_schemathesis(url: str, config: Path, *exclude: str) -> tuple[int, str]:
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file",
        str(config),
        "run",
        url + "/openapi.json",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing",
        "--suppress-health-check",
        "all",
        "--request-timeout",
        "30",
    ]
    for path in exclude:
        command += ["--exclude-path", path]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=config.parent)
    return done.returncode, done.stdout + done.stderr


def generated(output: str) -> int:
    found = re.search(r"(\d+) generated", output)
    assert found, output[-3000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def tensor_server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("fuzz-repo")
    slow_model(root, "echo", 0, max_batch_size=4)
    slow_model(root, "patchable", 0, max_batch_size=4)
    srv = start_module_server(["--model-repository", str(root)])
    srv.wait_ready()
    return srv


# Load, unload and profile with a real model would reload it, stop it, or hold it for up to a
# minute per example; the model pool's pin, unpin, preload and evict would evict it (an eager
# server never loads it back by itself) or change how it is kept: they are fuzzed with generated
# names only. Batching changes go only to a model nothing else uses (the digits server is shared
# by the whole session).
CONTROL = ("/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload", "/admin/models/{name}/profile",
           "/admin/models/{name}/pin", "/admin/models/{name}/unpin", "/admin/models/{name}/preload",
           "/admin/models/{name}/evict")
PATCHING = "/admin/models/{name}/batching"


def check(tmp_path: Path, url: str, real: dict[str, str] | None, label: str, exclude: tuple[str, ...] = ()) -> None:
    config = config_file(tmp_path / "schemathesis.toml", real)
    code, output = run_schemathesis(url, config, *exclude)
    cases = generated(output)
    print(f"\nschemathesis {label}: {cases} cases", file=sys.stderr)
    (tmp_path / "schemathesis.txt").write_text(output)
    assert code == 0, output[-8000:]
    assert cases >= 50


def test_every_operation_with_generated_names(digits_server, tmp_path):
    check(tmp_path, digits_server.url, None, "generated names")


def test_every_operation_with_the_digits_model(digits_server, tmp_path):
    check(tmp_path, digits_server.url, {"*": "digits"}, "digits model", (*CONTROL, PATCHING))


def test_every_operation_with_tensor_models(tensor_server, tmp_path):
    check(tmp_path, tensor_server.url, {"*": "echo", PATCHING: "patchable"}, "tensor models", CONTROL)
