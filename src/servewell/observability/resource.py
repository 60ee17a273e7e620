"""The OpenTelemetry resource of servewell's tracer providers (imported only when tracing is on)."""

from __future__ import annotations

from opentelemetry.sdk.resources import Attributes, Resource


class HashedResource(Resource):
    """A Resource that hashes once. The OTLP encoder groups every exported span by its resource,
    and the SDK's `Resource.__hash__` serializes the attributes to JSON each time: 15% of the
    encoding (measured: 6.5 of 47 us per span). A resource is immutable, so its hash is too."""

    def __init__(self, attributes: Attributes, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash
