"""OIP v2 over gRPC for the load generator, through `tritonclient.grpc.aio` (Triton's
GRPCInferenceService, which Triton, servewell and KServe runtimes serve).

One channel per benchmark: HTTP/2 multiplexes every in-flight request over it, so the
load loops' "connections" here are handles on the shared client, each one request at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servewell.perf.inputs import InputError, ModelMeta, Tensor
from servewell.perf.loop import Reply
from servewell.perf.oip_http import ServerError


def _tritonclient_grpc() -> tuple[Any, type[Exception]]:
    """tritonclient's asyncio gRPC module and its exception class (imported only when gRPC is used)."""
    try:
        import tritonclient.grpc.aio as grpc_aio
        from tritonclient.utils import InferenceServerException
    except ImportError as exc:
        raise ServerError("gRPC needs tritonclient's gRPC client: pip install 'tritonclient[grpc]' "
                          f"({exc})") from None
    return grpc_aio, InferenceServerException


def status_name(exc: Exception) -> str:
    """The gRPC status name of a tritonclient exception ("StatusCode.UNAVAILABLE" -> "UNAVAILABLE")."""
    status = getattr(exc, "status", None)
    text = str(status() if callable(status) else status or "UNKNOWN")
    return text.rsplit(".", 1)[-1] if text and text != "None" else "UNKNOWN"


class GrpcOipConnection:
    """A `Connection` handle on the shared gRPC client; payloads are prepared `InferInput` lists."""

    retries = 0

    def __init__(self, client: Any, error: type[Exception], model: str, version: str, outputs: list[Any],
                 headers: dict[str, str], timeout_s: float | None) -> None:
        self._client = client
        self._error = error
        self._model = model
        self._version = version
        self._outputs = outputs or None
        self._headers = headers or None
        # The server learns the client's deadline too, so it can drop a request nobody waits for.
        self._timeout_s = timeout_s

    async def connect(self) -> None:
        """Nothing to open: the channel is shared and connects on first use."""

    async def send(self, payload: Any) -> Reply:
        """One ModelInfer call."""
        try:
            await self._client.infer(self._model, payload, model_version=self._version, outputs=self._outputs,
                                     headers=self._headers, client_timeout=self._timeout_s)
        except self._error as exc:
            name = status_name(exc)
            return Reply(name, False, "deadline_exceeded" if name == "DEADLINE_EXCEEDED" else None)
        return Reply("OK", True)

    def close(self) -> None:
        """Nothing to close per handle."""


class GrpcOipClient:
    """The control side of a benchmark over gRPC: discovery, metadata, prepared requests."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None,
                 request_timeout_s: float | None = None) -> None:
        self.host = host
        self.port = port
        self.headers = dict(headers or {})
        self.request_timeout_s = request_timeout_s
        self._grpc, self._error = _tritonclient_grpc()
        self._client: Any = None
        self._model = ""
        self._version = ""
        self._outputs: list[Any] = []

    @property
    def client(self) -> Any:
        """The aio client, created inside the running loop (a gRPC aio channel belongs to one loop)."""
        if self._client is None:
            self._client = self._grpc.InferenceServerClient(f"{self.host}:{self.port}")
        return self._client

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except self._error as exc:
            message = exc.message() if hasattr(exc, "message") else str(exc)
            raise ServerError(f"gRPC {what} at {self.host}:{self.port} failed: {status_name(exc)}: {message}") from None

    async def resolve_model(self, model: str | None) -> str:
        """`model`, or the only ready model of the server's repository index."""
        if model:
            return model
        index = await self._call("RepositoryIndex", self.client.get_model_repository_index(
            headers=self.headers or None, as_json=True))
        models = index.get("models", []) if isinstance(index, dict) else []
        ready = sorted({str(m["name"]) for m in models if str(m.get("state", "READY")).upper() == "READY"})
        if len(ready) == 1:
            return ready[0]
        raise ServerError(f"the server has models {sorted(str(m.get('name')) for m in models)}; name one with --model")

    async def metadata(self, model: str, version: str | None = None) -> ModelMeta:
        """The model's metadata (ModelMetadata, as JSON) plus max_batch_size from ModelConfig when served."""
        doc = await self._call("ModelMetadata", self.client.get_model_metadata(
            model, model_version=version or "", headers=self.headers or None, as_json=True))
        meta = ModelMeta.from_metadata(doc)
        if not meta.inputs:
            raise InputError(f"model '{model}' declares no inputs in its metadata")
        if meta.max_batch_size is None:
            try:
                config = await self.client.get_model_config(model, model_version=version or "",
                                                           headers=self.headers or None, as_json=True)
                raw = (config.get("config") or {}).get("max_batch_size")
                if raw is not None:
                    meta = ModelMeta(meta.name, meta.versions, meta.platform, meta.inputs, meta.outputs,
                                     int(raw), meta.image_input)
            except self._error:
                pass  # ModelConfig is optional in the protocol: metadata alone will do
        return meta

    def prepare(self, model: ModelMeta, requests: Sequence[Sequence[Tensor]], version: str | None = None) -> list[Any]:
        """Every request as a list of `InferInput` with its data set (done once, before the clock)."""
        self._model, self._version = model.name, version or ""
        self._outputs = [self._grpc.InferRequestedOutput(t.name) for t in model.outputs]
        prepared = []
        for tensors in requests:
            inputs = []
            for tensor in tensors:
                item = self._grpc.InferInput(tensor.name, list(tensor.shape), tensor.datatype)
                item.set_data_from_numpy(tensor.array.reshape(tensor.shape))
                inputs.append(item)
            prepared.append(inputs)
        return prepared

    def connection(self) -> GrpcOipConnection:
        """A handle on the shared client."""
        return GrpcOipConnection(self.client, self._error, self._model, self._version, self._outputs, self.headers,
                                 self.request_timeout_s)

    async def close(self) -> None:
        """Close the channel."""
        if self._client is not None:
            await self._client.close()
            self._client = None
