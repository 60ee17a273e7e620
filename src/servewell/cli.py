"""`servewell serve | models | bench | tune`: the command line, generated from the config tree's field docs."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from servewell.config.server import ConfigFileError, ServerConfig, load_server_config
from servewell.perf.commands import add_perf_parsers

#: Nested settings that only a --config file sets.
_FILE_ONLY = ("alerting",)
_FLAG_TYPES = {int: int, float: float, str: str, Path: Path}


def _float_list(text: str) -> list[float]:
    """Comma-separated numbers, for list-valued settings."""
    return [float(part) for part in text.split(",") if part.strip()]


def _flag_type(annotation: object):  # noqa: ANN202 - a callable argparse uses as type
    if typing.get_origin(annotation) is list:
        return _float_list
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str
    base = args[0] if args else annotation
    if typing.get_origin(base) is typing.Literal:
        return str
    return _FLAG_TYPES.get(base, str)  # type: ignore[arg-type]


def _add_config_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    for name, field in ServerConfig.model_fields.items():
        if only is not None and name not in only:
            continue
        if name in _FILE_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        choices = None
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
        if typing.get_origin(inner[0]) is typing.Literal:
            choices = list(typing.get_args(inner[0]))
        default = field.default if field.default is not None else "none"
        if field.default_factory is not None:
            default = ",".join(str(v) for v in field.default_factory())
        parser.add_argument(
            flag, dest=name, type=_flag_type(field.annotation), choices=choices, default=None,
            help=f"{field.description} (default: {default})".replace("%", "%%"),
        )


def _settings(args: argparse.Namespace) -> ServerConfig:
    overrides = {name: getattr(args, name, None) for name in ServerConfig.model_fields}
    return load_server_config(args.config, overrides)


def _cmd_serve(args: argparse.Namespace) -> int:
    from servewell.observability.logging import configure_logging
    from servewell.server import serve

    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    if settings.model_repository is not None and not settings.model_repository.is_dir():
        print(f"servewell: model repository {settings.model_repository} is not a directory", file=sys.stderr)
        return 2
    serve(settings)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from servewell.engine.repository import scan_repository
    from servewell.server import builtin_repository

    settings = _settings(args)
    repository = settings.model_repository or builtin_repository(settings.cache_dir)
    if not repository.is_dir():
        print(f"servewell: model repository {repository} is not a directory"
              + ("" if settings.model_repository else " (the built-in model is built by the first `servewell serve`)"),
              file=sys.stderr)
        return 2
    sources = scan_repository(repository)
    print(f"model repository {repository}: {len(sources)} model(s)")
    for source in sources:
        if source.config is None:
            print(f"  {source.name:<20} INVALID  {source.error}")
        else:
            c = source.config
            print(f"  {source.name:<20} ok       version {c.version}, runtime {c.runtime}, {c.artifact}, "
                  f"max_batch_size {c.max_batch_size}, instances {c.instances}, device {c.device}")
    return 1 if any(s.config is None for s in sources) else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to render `--help`)."""
    parser = argparse.ArgumentParser(prog="servewell", description="Serve ONNX, TorchScript and PyTorch models over HTTP.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="start the server", description="Start the HTTP server; without "
                           "--model-repository it serves the built-in digits model.")
    serve.add_argument("--config", type=Path, default=None, help="YAML file with any of the settings below.")
    _add_config_flags(serve)
    serve.set_defaults(run=_cmd_serve)
    models = sub.add_parser("models", help="list a repository's models and why any is invalid",
                            description="List the models of a repository; exit code 1 if any is invalid.")
    models.add_argument("--config", type=Path, default=None, help="YAML file with settings.")
    _add_config_flags(models, only=("model_repository", "cache_dir"))
    models.set_defaults(run=_cmd_models)
    add_perf_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `servewell` command."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigFileError as exc:
        print(f"servewell: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
