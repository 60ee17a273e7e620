"""`servewell serve | models | keys | bench | tune | plan`: the command line, generated from the config
tree's field docs."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from servewell import __version__
from servewell.config.fields import list_item_type, split_items, strip_optional
from servewell.config.server import ConfigFileError, ConfigSource, ServerConfig
from servewell.perf.commands import add_perf_parsers
from servewell.workers.backends import ORT_TELEMETRY_SWITCH

#: Settings that only a --config file (or the environment) sets: nested ones, and secrets that
#: would show in `ps` as flags.
_FILE_ONLY = ("alerting", "api_keys", "payload_log")
_FLAG_TYPES: dict[object, Callable[[str], object]] = {int: int, float: float, str: str, Path: Path}


def _scalar_type(annotation: object) -> Callable[[str], object]:
    base = strip_optional(annotation)
    if typing.get_origin(base) is typing.Literal:
        return str  # argparse checks the choices
    return _FLAG_TYPES.get(base, str)


def _list_of(item: Callable[[str], object]) -> Callable[[str], list[object]]:
    def parse(text: str) -> list[object]:
        return [item(part) for part in split_items(text)]

    parse.__name__ = f"comma-separated {getattr(item, '__name__', 'value')}"  # argparse's "invalid ... value"
    return parse


def _flag_type(annotation: object) -> Callable[[str], object]:
    """How argparse reads a setting's flag: by its type annotation; list settings take comma-separated items."""
    item = list_item_type(annotation)
    return _list_of(_scalar_type(item)) if item is not None else _scalar_type(annotation)


def _add_config_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    for name, field in ServerConfig.model_fields.items():
        if only is not None and name not in only:
            continue
        if name in _FILE_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        base = strip_optional(field.annotation)
        choices = list(typing.get_args(base)) if typing.get_origin(base) is typing.Literal else None
        default = field.get_default(call_default_factory=True)
        if default is None:
            default = "none"
        elif isinstance(default, list):
            default = ",".join(str(v) for v in default)
        parser.add_argument(
            flag, dest=name, type=_flag_type(field.annotation), choices=choices, default=None,
            help=f"{field.description} (default: {default})".replace("%", "%%"),
        )


def _source(args: argparse.Namespace) -> ConfigSource:
    overrides = {name: getattr(args, name, None) for name in ServerConfig.model_fields}
    return ConfigSource(args.config, {k: v for k, v in overrides.items() if v is not None})


def _settings(args: argparse.Namespace) -> ServerConfig:
    return _source(args).load()


def _cmd_serve(args: argparse.Namespace) -> int:
    from servewell.observability.logging import configure_logging
    from servewell.process_tree import ingress_process_count

    source = _source(args)
    settings = source.load()
    configure_logging(settings.log_level, settings.log_format)
    if settings.model_repository is not None and not settings.model_repository.is_dir():
        print(f"servewell: model repository {settings.model_repository} is not a directory", file=sys.stderr)
        return 2
    if ingress_process_count(settings.ingress_processes) >= 1:
        from servewell.supervisor import run  # the supervisor never imports the server's stack

        return run(settings, source)
    from servewell.server import serve

    serve(settings, source)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from servewell.cpu_limit import affinity_cpus, cpu_quota, usable_cpus
    from servewell.engine.memory_budget import machine_memory_budget
    from servewell.repository_report import available_cpus, cpu_warning, render, report_repository
    from servewell.server import builtin_repository

    settings = _settings(args)
    repository = settings.model_repository or builtin_repository(settings.cache_dir)
    if not repository.is_dir():
        print(f"servewell: model repository {repository} is not a directory"
              + ("" if settings.model_repository else " (the built-in model is built by the first `servewell serve`)"),
              file=sys.stderr)
        return 2
    # The budget the server would start with: the setting, else its share of the memory available now.
    budget = settings.memory_budget_bytes or machine_memory_budget()
    source = "--memory-budget-bytes" if settings.memory_budget_bytes else "default: a share of the memory available now"
    reports = report_repository(repository, budget, available_cpus(), check_factories=not args.no_factory_check,
                                check_graphs=not args.no_graph_check, mode=settings.repository_mode)
    quota = cpu_quota()
    why = f"{affinity_cpus()} in its affinity mask" + (f", CPU limit {quota:g} from its control group" if quota else "")
    warning = cpu_warning(reports, usable_cpus(), why)
    print(render(repository, budget, source, reports, [warning] if warning else [], mode=settings.repository_mode))
    return 1 if any(report.status != "ok" for report in reports) else 0


def _cmd_keys(args: argparse.Namespace) -> int:
    import secrets

    from servewell.tenancy.keys import KeyFormatError, key_digest, parse_keys

    if args.action == "new":
        key = secrets.token_urlsafe(32)
        print(f"key (give it to the client; it is not stored anywhere): {key}")
        print(f"line for --api-keys-file (only the hash):  {args.id}:{key_digest(key)}")
        return 0
    key = sys.stdin.readline().strip()
    try:
        parse_keys([f"{args.id}:{key}"], "stdin")
    except KeyFormatError as exc:
        print(f"servewell: {exc}", file=sys.stderr)
        return 2
    print(f"{args.id}:{key_digest(key)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to render `--help`)."""
    parser = argparse.ArgumentParser(prog="servewell",
                                     description="Serve ONNX, TorchScript and PyTorch models over HTTP.")
    parser.add_argument("--version", action="version", version=f"servewell {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="start the server", description="Start the HTTP server; without "
                           "--model-repository it serves the built-in digits model.")
    serve.add_argument("--config", type=Path, default=None, help="YAML file with any of the settings below.")
    _add_config_flags(serve)
    serve.set_defaults(run=_cmd_serve)
    models = sub.add_parser(
        "models", help="check a repository's models: problems, memory against the budget, settings",
        description="Check every model of a repository as the server would load it: each problem of its "
        "model.yaml (file, field, reason), its CPU affinity on this machine, a pytorch factory built on the meta "
        "device and its weights' names and shapes, a python model's entry class, an ONNX graph's inputs and "
        "outputs, and its estimated memory "
        "against the memory budget as the repository mode uses it (eager: every model at start; lazy: the pinned "
        "ones at start, the others on demand, refused only when they could never fit); shows the effective settings. "
        "Exit code 1 if any model is invalid or would be refused.")
    models.add_argument("--config", type=Path, default=None, help="YAML file with settings.")
    models.add_argument("--no-factory-check", action="store_true",
                        help="do not import pytorch factories nor python models' entry classes (each check starts "
                        "a process that imports torch or the model's code)")
    models.add_argument("--no-graph-check", action="store_true",
                        help="do not open ONNX graphs (each check starts a process that imports onnxruntime)")
    _add_config_flags(models, only=("model_repository", "cache_dir", "memory_budget_bytes", "repository_mode"))
    models.set_defaults(run=_cmd_models)
    keys = sub.add_parser("keys", help="make API keys and the hashed lines of a keys file",
                          description="new: print a fresh random key and its hashed line for --api-keys-file; "
                          "hash: read a key on stdin and print its hashed line.")
    keys.add_argument("action", choices=("new", "hash"))
    keys.add_argument("--id", default="client", help="the key's id (appears in logs and metrics; default: client)")
    keys.set_defaults(run=_cmd_keys)
    add_perf_parsers(sub)
    # The fleet planner is its own package (servewell_plan, usable with the `plan` extra): only its
    # argparse module is imported here, its simulator when `servewell plan` runs, and the server never.
    from servewell_plan.commands import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `servewell` command."""
    # onnxruntime (1.29 and later) starts a telemetry uploader in every process that imports it and
    # keeps an event database in ~/.cache: a server's workers have no business phoning home, and
    # the spares' fork server must not hold that thread or database when it forks. A user who
    # wants it sets the variable to 0.
    os.environ.setdefault(ORT_TELEMETRY_SWITCH, "1")
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigFileError as exc:
        print(f"servewell: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
