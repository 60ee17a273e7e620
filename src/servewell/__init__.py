"""servewell: a model-serving backend that does not fall over on launch day."""

__version__ = "0.1.0"
