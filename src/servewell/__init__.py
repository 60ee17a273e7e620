"""servewell: a model-serving backend that does not fall over on launch day."""

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - lazy, so `import servewell` stays light
    if name == "trace_step":
        from servewell.observability.steps import trace_step

        return trace_step
    raise AttributeError(name)
