"""Fitting the connection limits to the process's open-file limit: every connection needs a
descriptor, so the soft limit is raised to hold them all, or `max_connections` lowered to fit it."""

from __future__ import annotations

import dataclasses
import logging
import resource
from typing import TYPE_CHECKING

from servewell.config.server import ConfigFileError

if TYPE_CHECKING:
    from servewell.api.http_limit_rules import HttpLimits

log = logging.getLogger("servewell.http")

#: Largest listen backlog passed to uvicorn (its default); smaller when fewer connections are allowed.
LISTEN_BACKLOG = 2048
#: Descriptors the frontend needs besides client sockets: listeners, worker pipes and shared
#: memory, model files, logs, gRPC and OTLP exporters (about 60 with four models; room to spare).
FD_OVERHEAD = 256


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft open-file limit towards `wanted` (never past the hard limit, never lower);
    the soft limit that results (`wanted` when it is unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def _descriptors_needed(connections: int) -> int:
    # A burst as large as the backlog can be accepted in one loop iteration before any refusal
    # closes its socket: the backlog's worth of descriptors must fit too.
    return connections + min(LISTEN_BACKLOG, connections) + FD_OVERHEAD


def fit_to_fd_limit(limits: HttpLimits) -> tuple[HttpLimits, int]:
    """`limits` with `max_connections` lowered (with a warning) if the open-file limit cannot hold
    them after raising it, and the listen backlog to use. Refuses to start (`ConfigFileError`)
    when not even 16 connections fit."""
    total = limits.max_connections + limits.reserved_connections
    available = raise_fd_limit(_descriptors_needed(total))
    if available >= _descriptors_needed(total):
        return limits, min(LISTEN_BACKLOG, total)
    fitting = (available - FD_OVERHEAD) // 2 - limits.reserved_connections  # below the backlog cap, both halves grow
    if fitting < 16:
        raise ConfigFileError(f"the open-file limit ({available}) leaves room for {max(fitting, 0)} connections "
                              f"(each needs a descriptor, as does the listen backlog, plus {FD_OVERHEAD} for the "
                              "server itself): raise `ulimit -n`")
    log.warning("the open-file limit (%d) holds %d connections, not the configured %d: max_connections lowered; raise "
                "`ulimit -n` to keep it", available, fitting, limits.max_connections,
                extra={"fd_limit": available, "max_connections": fitting})
    backlog = min(LISTEN_BACKLOG, fitting + limits.reserved_connections)
    return dataclasses.replace(limits, max_connections=fitting), backlog
