"""servewell's app behind uvicorn's stock HTTP protocols, for comparing against `servewell serve`.

    python -m bench.http_variants {plain|h11} [servewell serve flags...]

`plain` is how servewell ran before the HTTP limits (httptools, no limits); `h11` is uvicorn's
pure-Python parser with its one native head bound (`h11_max_incomplete_event_size`), the
alternative to enforcing limits in our own protocol. Same app, same settings, same uvicorn
options otherwise (see `servewell.server.serve`).
"""

from __future__ import annotations

import sys

import uvicorn

from servewell.cli import build_parser
from servewell.config.server import ServerConfig, load_server_config
from servewell.observability.logging import configure_logging
from servewell.server import build_app

VARIANTS = {
    "plain": {"http": "httptools"},
    "h11": {"http": "h11", "h11_max_incomplete_event_size": 16_384},
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in VARIANTS:
        print(f"usage: python -m bench.http_variants {{{'|'.join(VARIANTS)}}} [serve flags]", file=sys.stderr)
        return 2
    args = build_parser().parse_args(["serve", *argv[1:]])
    settings = load_server_config(args.config, {n: getattr(args, n, None) for n in ServerConfig.model_fields})
    configure_logging(settings.log_level, settings.log_format)
    app, _ = build_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=30, lifespan="on", **VARIANTS[argv[0]])  # type: ignore[arg-type]
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
