"""servewell: a model-serving backend that does not fall over on launch day."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servewell.observability.steps import trace_step as trace_step

#: The one place the version lives (pyproject.toml reads it from here).
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`servewell.trace_step`, imported on first use, so `import servewell` stays light."""
    if name == "trace_step":
        from servewell.observability.steps import trace_step

        return trace_step
    raise AttributeError(name)
