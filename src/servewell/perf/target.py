"""Where a benchmark sends its load: a URL (http://, grpc://) or a local model directory or
repository, which gets its own `servewell serve` for the length of the run."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from servewell.perf.inputs import (
    InputError,
    ModelMeta,
    Tensor,
    generate_inputs,
    image_inputs,
    npy_inputs,
    parse_input_files,
)
from servewell.perf.local_server import MODEL_FILE, LocalServer, stage_model
from servewell.perf.oip_grpc import GrpcOipClient
from servewell.perf.oip_http import Format, HttpOipClient
from servewell.perf.sweep import PreparedTarget

Protocol = Literal["http", "grpc"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server address and the protocol to speak to it."""

    protocol: Protocol
    host: str
    port: int

    @property
    def url(self) -> str:
        """`http://host:port` or `grpc://host:port`."""
        return f"{self.protocol}://{self.host}:{self.port}"


def parse_endpoint(text: str, protocol: Protocol | None = None) -> Endpoint:
    """`http://host:port`, `grpc://host:port`, or `host:port` (HTTP unless --protocol grpc)."""
    parts = urlsplit(text if "://" in text else f"{protocol or 'http'}://{text}")
    scheme = parts.scheme.lower()
    if scheme not in ("http", "grpc"):
        raise ValueError(f"{text!r}: use http://HOST:PORT or grpc://HOST:PORT (https is not supported)")
    if protocol is not None and protocol != scheme:
        raise ValueError(f"{text!r} is a {scheme} URL but --protocol is {protocol}")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{text!r}: give the server's base URL only; the model is named with --model")
    if not parts.hostname:
        raise ValueError(f"{text!r} names no host")
    try:
        port = parts.port or (80 if scheme == "http" else 8001)
    except ValueError:
        raise ValueError(f"{text!r} has an invalid port") from None
    return Endpoint("grpc" if scheme == "grpc" else "http", parts.hostname, port)


@dataclass(slots=True)
class InputChoice:
    """How request inputs are made (see `servewell.perf.inputs`)."""

    npy: Sequence[str] = ()
    images: Sequence[Path] = ()
    image_input: str | None = None
    batch_size: int = 1
    dynamic_size: int = 8
    shapes: dict[str, list[int]] = field(default_factory=dict)
    variants: int = 4
    seed: int = 1

    def build(self, model: ModelMeta) -> tuple[list[list[Tensor]], str]:
        """The requests' tensors, and a word for where they came from."""
        if self.npy and self.images:
            raise InputError("give either --input .npy files or --image files, not both")
        if self.npy:
            return npy_inputs(model, parse_input_files(self.npy, model)), "npy"
        if self.images:
            return image_inputs(model, self.images, self.image_input, self.batch_size), "images"
        return generate_inputs(model, variants=self.variants, batch_size=self.batch_size,
                               dynamic_size=self.dynamic_size, shapes=self.shapes, seed=self.seed), "generated"


async def prepare_target(endpoint: Endpoint, model: str | None, version: str | None, fmt: Format,
                         inputs: InputChoice, headers: dict[str, str] | None = None,
                         request_timeout_s: float | None = None) -> tuple[PreparedTarget, dict[str, Any]]:
    """Ask the server for the model's metadata, build and encode the requests.

    Returns the target and a description of the inputs for the report. Must run inside the
    event loop that will drive the load (a gRPC channel belongs to one loop).
    """
    if endpoint.protocol == "grpc":
        grpc_client = GrpcOipClient(endpoint.host, endpoint.port, headers, request_timeout_s)
        try:
            meta = await grpc_client.metadata(await grpc_client.resolve_model(model), version)
            tensors, source = inputs.build(meta)
            payloads = grpc_client.prepare(meta, tensors, version)
        except BaseException:
            await grpc_client.close()
            raise
        target = PreparedTarget(grpc_client, meta, payloads, "grpc", "protobuf", endpoint.url)
    else:
        http_client = HttpOipClient(endpoint.host, endpoint.port, headers)
        meta = await http_client.metadata(await http_client.resolve_model(model), version)
        tensors, source = inputs.build(meta)
        payloads = http_client.prepare(meta, tensors, fmt, version)
        target = PreparedTarget(http_client, meta, payloads, "http", fmt, endpoint.url)
    described = {
        "source": source, "requests": len(tensors),
        "tensors": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors[0]],
    }
    return target, described


def start_local(path: Path, stack: ExitStack, log_dir: Path | None, grpc: bool,
                extra_args: tuple[str, ...] = (), *, port: int = 0, grpc_port: int = 0,
                load_timeout_s: float | None = None) -> tuple[LocalServer, str | None]:
    """Serve a model directory (or a whole repository) on loopback ports (`port`, `grpc_port`: 0 for
    free ones) until `stack` closes, which stops the server and removes its temporary directory.

    Returns the server and the model name when `path` is one model's directory.
    """
    path = path.resolve()
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="servewell-bench-")))
    if (path / MODEL_FILE).is_file():
        repository = workdir / "repository"
        model: str | None = stage_model(path, repository)
    else:
        repository, model = path, None
    server = LocalServer(repository, (log_dir or workdir) / "servewell.log", grpc=grpc, extra_args=extra_args,
                         port=port, grpc_port=grpc_port, load_timeout_s=load_timeout_s)
    server.start()
    stack.callback(server.stop)
    return server, model
