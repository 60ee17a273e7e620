"""The `servewell` command in-process: `serve --help` lists every setting of the config tree with
its default, `models` reports a repository with exit codes a script can use, and settings given
as flag, environment variable and config file take effect in that order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from servewell import __version__
from servewell.cli import main
from servewell.config.server import ServerConfig

#: Nested settings that only a --config file sets: they have no flag.
FILE_ONLY = {"alerting", "api_keys", "payload_log"}  # nested, or a secret that must not be a flag (ps shows flags)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `servewell ARGV`."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help and --version
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def onnx_model_dir(root: Path, name: str, **fields: object) -> None:
    """A model directory `servewell models --no-graph-check` accepts (it checks config and files, it loads nothing)."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "model.onnx").write_bytes(b"not loaded by `servewell models`")
    config = {"runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 4,
              "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}], **fields}
    (directory / "model.yaml").write_text(yaml.safe_dump(config))


def test_serve_help_lists_every_setting_with_its_default(capsys):
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", out))
    settings = {"--" + name.replace("_", "-") for name in ServerConfig.model_fields if name not in FILE_ONLY}
    assert flags == settings | {"--help", "--config"}
    text = " ".join(out.split())  # argparse wraps the help lines
    assert "TCP port to listen on. (default: 8000)" in text
    assert "--log-format {json,console}" in text and "(default: json)" in text
    assert "(default: 0.001,0.0025,0.005" in text  # a list default, as the flag takes it


def test_ingress_processes_is_a_serve_flag_whose_default_is_chosen_from_the_cores():
    from servewell.cli import build_parser

    assert build_parser().parse_args(["serve", "--ingress-processes", "0"]).ingress_processes == 0
    assert build_parser().parse_args(["serve"]).ingress_processes is None  # unset: the rule of process_tree


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"servewell {__version__}"


def test_models_lists_valid_and_invalid_models_and_exits_1(tmp_path, capsys):
    onnx_model_dir(tmp_path, "good", version="3", instances=2)
    onnx_model_dir(tmp_path, "bad", max_batch_size="lots")
    code, out, _ = run(capsys, "models", "--no-graph-check", "--model-repository", str(tmp_path))
    assert code == 1  # a script can tell that something is wrong
    header, *lines = out.splitlines()
    assert header.startswith(f"model repository {tmp_path}: 2 model(s); memory budget ")
    # One block per model: its name on the first line, details indented under it.
    blocks: dict[str, str] = {}
    for line in lines:
        if not line.startswith("   "):
            name = line.split()[0]
        blocks[name] = blocks.get(name, "") + line + "\n"
    assert set(blocks) == {"good", "bad"}
    assert " ok " in blocks["good"] and "version 3" in blocks["good"] and "2 instances" in blocks["good"]
    assert "INVALID" in blocks["bad"] and "bad/model.yaml" in blocks["bad"]
    assert "field 'max_batch_size'" in blocks["bad"]


def test_models_exits_0_when_every_model_is_valid(tmp_path, capsys):
    onnx_model_dir(tmp_path, "good")
    code, out, _ = run(capsys, "models", "--no-graph-check", "--model-repository", str(tmp_path))
    assert code == 0 and "INVALID" not in out


def test_models_on_a_missing_repository_exits_2(tmp_path, capsys):
    code, out, err = run(capsys, "models", "--model-repository", str(tmp_path / "absent"))
    assert code == 2 and out == ""
    assert f"model repository {tmp_path / 'absent'} is not a directory" in err


def test_an_invalid_config_file_exits_2_naming_file_and_field(tmp_path, capsys):
    config = tmp_path / "servewell.yaml"
    config.write_text("port: 0\n")
    code, _, err = run(capsys, "serve", "--config", str(config))
    assert code == 2
    assert err.startswith("servewell: ") and str(config) in err and "field 'port'" in err


def test_flag_beats_environment_beats_config_file(tmp_path, capsys, monkeypatch):
    repos = {}
    for source in ("flag", "env", "file"):
        repos[source] = tmp_path / source
        onnx_model_dir(repos[source], "m")
    config = tmp_path / "servewell.yaml"
    config.write_text(yaml.safe_dump({"model_repository": str(repos["file"])}))
    monkeypatch.setenv("SERVEWELL_MODEL_REPOSITORY", str(repos["env"]))

    def repository_used(*flags: str) -> str:
        code, out, err = run(capsys, "models", "--no-graph-check", "--config", str(config), *flags)
        assert code == 0, err
        return out.splitlines()[0]

    assert repository_used("--model-repository", str(repos["flag"])).startswith(f"model repository {repos['flag']}:")
    assert repository_used().startswith(f"model repository {repos['env']}:")
    monkeypatch.delenv("SERVEWELL_MODEL_REPOSITORY")
    assert repository_used().startswith(f"model repository {repos['file']}:")
