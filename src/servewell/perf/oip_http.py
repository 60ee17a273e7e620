"""OIP v2 over HTTP for the load generator: request encoding (JSON or the binary tensor
extension), model discovery and metadata, and the `Connection` the load loops drive.

Requests are encoded once, before the clock starts; each send writes pre-built bytes.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import orjson

from servewell.perf.httpclient import HttpConnection, HttpResponse, encode_request, fetch
from servewell.perf.inputs import InputError, ModelMeta, Tensor
from servewell.perf.loop import Reply

Format = Literal["json", "binary"]


class ServerError(RuntimeError):
    """The server under test could not be asked what the benchmark needs (down, no such model)."""


def _json_data(tensor: Tensor) -> list[Any]:
    if tensor.datatype != "BYTES":
        return list(tensor.array.reshape(-1).tolist())
    if tensor.images:  # OIP JSON cannot carry raw bytes; servewell reads encoded images as base64
        return [base64.b64encode(b).decode("ascii") for b in tensor.array]
    return [b.decode("utf-8", "replace") for b in tensor.array]


def _raw_bytes(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in tensor.array)
    array = tensor.array
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def infer_body(tensors: Sequence[Tensor], fmt: Format,
               outputs: Sequence[str] = ()) -> tuple[bytes, dict[str, str], str]:
    """(body, extra headers, content type) of one infer request.

    Binary: the JSON header carries `binary_data_size` per input and asks for binary outputs;
    its length goes in `Inference-Header-Content-Length` and the raw tensors follow it.
    """
    if fmt == "json":
        doc = {"inputs": [{"name": t.name, "shape": list(t.shape), "datatype": t.datatype, "data": _json_data(t)}
                          for t in tensors]}
        return orjson.dumps(doc), {}, "application/json"
    blobs = [_raw_bytes(t) for t in tensors]
    header: dict[str, Any] = {
        "inputs": [{"name": t.name, "shape": list(t.shape), "datatype": t.datatype,
                    "parameters": {"binary_data_size": len(blob)}} for t, blob in zip(tensors, blobs, strict=True)],
    }
    if outputs:
        header["outputs"] = [{"name": name, "parameters": {"binary_data": True}} for name in outputs]
    head = orjson.dumps(header)
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}, "application/octet-stream"


def error_code(body: bytes) -> str | None:
    """servewell's machine-readable error code of an error body; None for other servers' bodies.

    OIP routes answer `{"error": "<message>", "code": ...}`; other routes (and older servewell
    versions, on every route) `{"error": {"code": ...}}`: both are read."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    error = doc.get("error")
    code = error.get("code") if isinstance(error, dict) else doc.get("code") if isinstance(error, str) else None
    return str(code) if code is not None else None


class HttpOipConnection:
    """A `Connection` over one keep-alive HTTP/1.1 socket; payloads are pre-encoded requests."""

    def __init__(self, host: str, port: int) -> None:
        self._http = HttpConnection(host, port)

    @property
    def retries(self) -> int:
        """Requests resent because the server had closed an idle keep-alive connection."""
        return self._http.retries

    async def connect(self) -> None:
        """Open the socket now."""
        await self._http.connect()

    async def send(self, payload: Any) -> Reply:
        """Send one pre-encoded request (bytes)."""
        response = await self._http.request(payload)
        ok = response.status == 200
        return Reply(str(response.status), ok, None if ok else error_code(response.body), response.timings)

    def close(self) -> None:
        """Close the socket."""
        self._http.close()


class HttpOipClient:
    """The control side of a benchmark over HTTP: discovery, metadata, prepared requests."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s

    async def _get_json(self, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
        try:
            response: HttpResponse = await fetch(self.host, self.port, method, path, body, self.timeout_s,
                                                 self.headers)
        except (OSError, TimeoutError) as exc:
            raise ServerError(f"{method} http://{self.host}:{self.port}{path} failed: {exc!r}") from None
        try:
            return response.status, orjson.loads(response.body) if response.body else None
        except orjson.JSONDecodeError:
            return response.status, None

    async def resolve_model(self, model: str | None) -> str:
        """`model`, or the only model of the server's repository index."""
        if model:
            return model
        status, index = await self._get_json("POST", "/v2/repository/index", b"{}")
        if status != 200 or not isinstance(index, list):
            raise ServerError(f"the server did not list its models (status {status}); name one with --model")
        names = sorted({str(m.get("name")) for m in index if isinstance(m, dict) and m.get("name")})
        ready = sorted({str(m.get("name")) for m in index
                        if isinstance(m, dict) and str(m.get("state", "")).upper() in ("READY", "")})
        if len(ready) == 1:
            return ready[0]
        raise ServerError(f"the server has models {names}; name one with --model")

    async def metadata(self, model: str, version: str | None = None) -> ModelMeta:
        """The model's OIP metadata (`GET /v2/models/{name}[/versions/{v}]`)."""
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        status, doc = await self._get_json("GET", path)
        if status != 200 or not isinstance(doc, dict):
            detail = doc.get("error") if isinstance(doc, dict) else doc
            raise ServerError(f"GET {path} answered {status}: {detail}")
        meta = ModelMeta.from_metadata(doc)
        if not meta.inputs:
            raise InputError(f"model '{model}' declares no inputs in its metadata")
        return meta

    def infer_path(self, model: str, version: str | None = None) -> str:
        """The infer endpoint of a model (version)."""
        return f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"

    def prepare(self, model: ModelMeta, requests: Sequence[Sequence[Tensor]], fmt: Format,
                version: str | None = None) -> list[bytes]:
        """Every request fully encoded (request line, headers, body), ready to be written."""
        path = self.infer_path(model.name, version)
        outputs = [t.name for t in model.outputs] if fmt == "binary" else []
        prepared = []
        for tensors in requests:
            body, extra, content_type = infer_body(tensors, fmt, outputs)
            prepared.append(encode_request("POST", f"{self.host}:{self.port}", path, body,
                                           {**self.headers, **extra}, content_type))
        return prepared

    def connection(self) -> HttpOipConnection:
        """A new lazily connecting `Connection`."""
        return HttpOipConnection(self.host, self.port)

    async def close(self) -> None:
        """Nothing to release: every control request used its own connection."""
