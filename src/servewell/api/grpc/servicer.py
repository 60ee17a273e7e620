"""The OIP v2 gRPC service: Triton's `inference.GRPCInferenceService` as `tritonclient.grpc` speaks
it (KServe's `GRPCInferenceService` is the same package, service and messages for the calls they
share), served from the same engine and data plane as HTTP.

Implemented: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelConfig,
ModelInfer (raw and typed contents), RepositoryIndex, RepositoryModelLoad/Unload (admin). The
Triton-only calls (statistics, shared-memory regions, trace and log settings, streaming) answer
UNIMPLEMENTED.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

import servewell
from servewell.api.access import came_through_proxy, check_admin, grpc_peer_host
from servewell.api.dataplane import DataPlane, select_outputs
from servewell.api.grpc.codec import decode_request, encode_response, metadata_value
from servewell.api.grpc.scope import RpcContext, RpcScope
from servewell.config.model import ModelConfig
from servewell.engine.protocol import ModelView, ServingEngine, client_shape
from servewell.errors import InvalidInput
from servewell.observability.context import request_id_var

EXTENSIONS = ("model_repository", "binary_tensor_data", "classification_free_parameters")
PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pytorch": "pytorch"}
TRITON_STATES = {"ready": "READY", "loading": "LOADING", "restarting": "LOADING"}


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Every call runs inside `RpcScope` (request id, trace, metrics, errors as statuses)."""

    def __init__(self, engine: ServingEngine, plane: DataPlane, scope: RpcScope, admin_token: str | None, *,
                 trust_loopback_admin: bool) -> None:
        self._engine = engine
        self._plane = plane
        self._scope = scope
        self._admin_token = admin_token
        self._trust_loopback_admin = trust_loopback_admin

    # --- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: RpcContext) -> pb.ServerLiveResponse:
        async def handle() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)
        return await self._scope.run("ServerLive", context, handle, probe=True)

    async def ServerReady(self, request: pb.ServerReadyRequest,
                          context: RpcContext) -> pb.ServerReadyResponse:
        async def handle() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self._engine.ready)
        return await self._scope.run("ServerReady", context, handle, probe=True)

    async def ModelReady(self, request: pb.ModelReadyRequest,
                         context: RpcContext) -> pb.ModelReadyResponse:
        async def handle() -> pb.ModelReadyResponse:
            self._plane.note_model(request.name)
            view = self._engine.model(request.name, request.version or None)
            return pb.ModelReadyResponse(ready=view.state == "ready")
        return await self._scope.run("ModelReady", context, handle, probe=True)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: RpcContext) -> pb.ServerMetadataResponse:
        async def handle() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(name="servewell", version=servewell.__version__, extensions=EXTENSIONS)
        return await self._scope.run("ServerMetadata", context, handle)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: RpcContext) -> pb.ModelMetadataResponse:
        async def handle() -> pb.ModelMetadataResponse:
            self._plane.note_model(request.name)
            view = self._engine.model(request.name, request.version or None)
            config = _valid_config(view)
            response = pb.ModelMetadataResponse(name=view.name, versions=[view.version],
                                                platform=PLATFORMS[config.runtime])
            for spec in config.inputs:
                response.inputs.add(name=spec.name, datatype=spec.datatype, shape=client_shape(config, spec))
            for spec in config.outputs:
                response.outputs.add(name=spec.name, datatype=spec.datatype, shape=client_shape(config, spec))
            return response
        return await self._scope.run("ModelMetadata", context, handle)

    async def ModelConfig(self, request: pb.ModelConfigRequest,
                          context: RpcContext) -> pb.ModelConfigResponse:
        async def handle() -> pb.ModelConfigResponse:
            self._plane.note_model(request.name)
            view = self._engine.model(request.name, request.version or None)
            return pb.ModelConfigResponse(config=_model_config(view))
        return await self._scope.run("ModelConfig", context, handle)

    # --- inference -------------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest,
                         context: RpcContext) -> pb.ModelInferResponse:
        async def handle() -> pb.ModelInferResponse:
            call = self._plane.call()
            metadata = context.invocation_metadata()
            model = call.open(request.model_name, request.model_version or None, metadata_value(metadata, "x-urgency"))
            with call.preprocessing():
                decoded = decode_request(request)
                inputs = await call.model_inputs(decoded.inputs)
            timeout_ms = decoded.timeout_us / 1000.0 if decoded.timeout_us is not None else None
            remaining_s = context.time_remaining()
            if remaining_s is not None:  # the caller's gRPC deadline bounds the request's own
                timeout_ms = min(timeout_ms, remaining_s * 1000.0) if timeout_ms is not None else remaining_s * 1000.0
            result = await call.infer(inputs, priority=decoded.priority, timeout_ms=timeout_ms)
            with call.postprocessing():
                outputs = select_outputs(model.name, result.outputs, decoded.requested_outputs)
                response = encode_response(model.name, model.config.version, request.id, outputs)
            context.set_trailing_metadata((("x-request-id", request_id_var.get()),
                                           ("server-timing", call.finish(result))))
            return response
        return await self._scope.run("ModelInfer", context, handle)

    # --- repository --------------------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context: RpcContext) -> pb.RepositoryIndexResponse:
        async def handle() -> pb.RepositoryIndexResponse:
            response = pb.RepositoryIndexResponse()
            for view in self._engine.models():
                if request.ready and view.state != "ready":
                    continue
                response.models.add(name=view.name, version=view.version,
                                    state=TRITON_STATES.get(view.state, "UNAVAILABLE"), reason=view.reason or "")
            return response
        return await self._scope.run("RepositoryIndex", context, handle)

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: RpcContext) -> pb.RepositoryModelLoadResponse:
        async def handle() -> pb.RepositoryModelLoadResponse:
            self._require_admin(context)
            self._plane.note_model(request.model_name)
            await self._engine.load_model(request.model_name)
            return pb.RepositoryModelLoadResponse()
        return await self._scope.run("RepositoryModelLoad", context, handle, admin=True)

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: RpcContext) -> pb.RepositoryModelUnloadResponse:
        async def handle() -> pb.RepositoryModelUnloadResponse:
            self._require_admin(context)
            self._plane.note_model(request.model_name)
            await self._engine.unload_model(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        return await self._scope.run("RepositoryModelUnload", context, handle, admin=True)

    def _require_admin(self, context: RpcContext) -> None:
        metadata = context.invocation_metadata() or ()
        check_admin(self._admin_token, metadata_value(metadata, "authorization"), grpc_peer_host(context.peer()),
                    proxied=came_through_proxy(key for key, _ in metadata),
                    trust_loopback=self._trust_loopback_admin)


def _valid_config(view: ModelView) -> ModelConfig:
    if view.config is None:
        raise InvalidInput(f"model '{view.name}' is invalid: {view.reason}")
    return view.config


def _model_config(view: ModelView) -> mc.ModelConfig:
    """The model's configuration in Triton's message, as `tritonclient.grpc.get_model_config` expects."""
    config = _valid_config(view)
    live_max = view.scheduling.max_batch_size if view.scheduling and config.max_batch_size else config.max_batch_size

    def dtype(datatype: str) -> int:
        return int(mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"))

    return mc.ModelConfig(
        name=config.name, platform=PLATFORMS[config.runtime], backend=config.runtime, max_batch_size=live_max,
        input=[mc.ModelInput(name=t.name, data_type=dtype(t.datatype), dims=t.shape) for t in config.inputs],
        output=[mc.ModelOutput(name=t.name, data_type=dtype(t.datatype), dims=t.shape) for t in config.outputs],
        instance_group=[mc.ModelInstanceGroup(
            count=config.instances,
            kind=mc.ModelInstanceGroup.KIND_GPU if config.device.startswith("cuda") else mc.ModelInstanceGroup.KIND_CPU,
        )],
        dynamic_batching=mc.ModelDynamicBatching(
            max_queue_delay_microseconds=int(config.batching.max_wait_ms * 1000),
            priority_levels=len(config.batching.lanes),
        ),
    )
