"""The OIP v2 gRPC service: Triton's `inference.GRPCInferenceService` as `tritonclient.grpc` speaks
it (KServe's `GRPCInferenceService` is the same package, service and messages for the calls they
share), served from the same engine and data plane as HTTP.

Implemented: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelConfig,
ModelInfer (raw and typed contents), RepositoryIndex, RepositoryModelLoad/Unload (admin). The
ModelStreamInfer (Triton's bidirectional stream: api/grpc/stream_infer.py). The other
Triton-only calls (statistics, shared-memory regions, trace and log settings) answer
UNIMPLEMENTED after the key check (`routing.ServiceRouter`). ModelReady needs a key like every
model call; only ServerLive and ServerReady are probes.

In a split server every ingress process serves this (its engine is `RemoteEngine`): inference
goes as envelopes; model views and repository calls are control operations (engine/control.py)
on the control plane (api/control_plane.py), the same ones the HTTP routes send, answered by the
engine's one table in this process or over the door; ServerReady answers from the ingress's own
readiness (the engine's verdict as last pushed, false while this ingress stops or has lost it).
"""

from __future__ import annotations

import asyncio

from tritonclient.grpc import service_pb2 as pb

import servewell
from servewell.api.access import AccessRule, came_through_proxy, grpc_peer_host
from servewell.api.control_plane import ControlPlane
from servewell.api.dataplane import DataPlane, select_outputs
from servewell.api.grpc.codec import config_message, decode_request, metadata_message, metadata_value, response_steps
from servewell.api.grpc.incoming import IncomingMessage
from servewell.api.grpc.scope import RpcContext, RpcScope
from servewell.api.grpc.stream_infer import model_stream_infer
from servewell.api.model_document import TRITON_STATES, model_document
from servewell.engine.control import DescribeModel, ListModels, LoadModel, UnloadModel
from servewell.engine.protocol import ServingEngine
from servewell.errors import NotFound, quote
from servewell.observability.context import request_id_var

EXTENSIONS = ("model_repository", "binary_tensor_data", "classification_free_parameters")


class InferenceServicer:
    """Every call runs inside `RpcScope` (key, message, call slot, request id, trace, metrics, errors
    as statuses); `routing.ServiceRouter` serves each method defined here, and only those."""

    def __init__(self, engine: ServingEngine, control: ControlPlane, plane: DataPlane, scope: RpcScope,
                 admin_token: str | None, *, trust_loopback_admin: bool) -> None:
        self._engine = engine
        self._control = control
        self._plane = plane
        self._scope = scope
        self._admin_token = admin_token
        self._trust_loopback_admin = trust_loopback_admin

    # --- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, incoming: IncomingMessage[pb.ServerLiveRequest],
                         context: RpcContext) -> pb.ServerLiveResponse:
        async def handle(request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)
        return await self._scope.run("ServerLive", context, incoming, handle, probe=True)

    async def ServerReady(self, incoming: IncomingMessage[pb.ServerReadyRequest],
                          context: RpcContext) -> pb.ServerReadyResponse:
        async def handle(request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=(await self._engine.readiness_async()).ready)
        return await self._scope.run("ServerReady", context, incoming, handle, probe=True)

    async def ModelReady(self, incoming: IncomingMessage[pb.ModelReadyRequest],
                         context: RpcContext) -> pb.ModelReadyResponse:
        async def handle(request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
            self._plane.note_model(request.name)
            try:
                view = await self._control.run(DescribeModel(request.name, request.version or None))
            except NotFound:  # say no more than the name asked for: the engine's message lists models
                asked = f"{quote(request.name)} version {quote(request.version)}" if request.version else quote(
                    request.name)
                raise NotFound(f"no model {asked}") from None
            return pb.ModelReadyResponse(ready=view.state == "ready" or view.loadable)
        return await self._scope.run("ModelReady", context, incoming, handle)

    async def ServerMetadata(self, incoming: IncomingMessage[pb.ServerMetadataRequest],
                             context: RpcContext) -> pb.ServerMetadataResponse:
        async def handle(request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(name="servewell", version=servewell.__version__, extensions=EXTENSIONS)
        return await self._scope.run("ServerMetadata", context, incoming, handle)

    async def ModelMetadata(self, incoming: IncomingMessage[pb.ModelMetadataRequest],
                            context: RpcContext) -> pb.ModelMetadataResponse:
        async def handle(request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
            self._plane.note_model(request.name)
            view = await self._control.run(DescribeModel(request.name, request.version or None))
            return metadata_message(model_document(view))
        return await self._scope.run("ModelMetadata", context, incoming, handle)

    async def ModelConfig(self, incoming: IncomingMessage[pb.ModelConfigRequest],
                          context: RpcContext) -> pb.ModelConfigResponse:
        async def handle(request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
            self._plane.note_model(request.name)
            view = await self._control.run(DescribeModel(request.name, request.version or None))
            return pb.ModelConfigResponse(config=config_message(model_document(view)))
        return await self._scope.run("ModelConfig", context, incoming, handle)

    # --- inference -------------------------------------------------------------------------

    async def ModelInfer(self, incoming: IncomingMessage[pb.ModelInferRequest],
                         context: RpcContext) -> pb.ModelInferResponse:
        async def handle(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
            call = self._plane.call()
            metadata = context.invocation_metadata()
            model = await call.open(request.model_name, request.model_version or None,
                                    metadata_value(metadata, "x-urgency"))
            with call.preprocessing():
                decoded = decode_request(request)
                inputs = await call.model_inputs(decoded.inputs)
            timeout_ms = decoded.timeout_us / 1000.0 if decoded.timeout_us is not None else None
            remaining_s = context.time_remaining()
            # The caller's gRPC deadline bounds the request's own, as an absolute time on the deadline clock.
            not_after = asyncio.get_running_loop().time() + remaining_s if remaining_s is not None else None
            result = await call.infer(inputs, priority=decoded.priority, timeout_ms=timeout_ms, not_after=not_after,
                                      oip_id=request.id or None)
            outputs = select_outputs(model.name, result.outputs, decoded.requested_outputs)
            version = result.version or model.config.version  # a traffic split may have drawn another
            # A large answer is encoded in steps, the event loop taking turns between them.
            response = await call.encode(outputs, response_steps(model.name, version, request.id, outputs))
            context.set_trailing_metadata((("x-request-id", request_id_var.get()),
                                           ("server-timing", call.finish(result)), ("x-model-version", version)))
            return response
        return await self._scope.run("ModelInfer", context, incoming, handle)

    async def ModelStreamInfer(self, request_iterator: object, context: RpcContext) -> None:
        """Triton's bidirectional stream: each request's parts as responses (api/grpc/stream_infer.py)."""
        await model_stream_infer(self._plane, self._scope, context)

    # --- repository --------------------------------------------------------------------------

    async def RepositoryIndex(self, incoming: IncomingMessage[pb.RepositoryIndexRequest],
                              context: RpcContext) -> pb.RepositoryIndexResponse:
        async def handle(request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
            response = pb.RepositoryIndexResponse()
            for view in await self._control.run(ListModels()):
                if request.ready and view.state != "ready":
                    continue
                response.models.add(name=view.name, version=view.version,
                                    state=TRITON_STATES.get(view.state, "UNAVAILABLE"), reason=view.reason or "")
            return response
        return await self._scope.run("RepositoryIndex", context, incoming, handle)

    async def RepositoryModelLoad(self, incoming: IncomingMessage[pb.RepositoryModelLoadRequest],
                                  context: RpcContext) -> pb.RepositoryModelLoadResponse:
        async def handle(request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
            self._require_admin(context)
            self._plane.note_model(request.model_name)
            await self._control.run(LoadModel(request.model_name))
            return pb.RepositoryModelLoadResponse()
        return await self._scope.run("RepositoryModelLoad", context, incoming, handle, admin=True)

    async def RepositoryModelUnload(self, incoming: IncomingMessage[pb.RepositoryModelUnloadRequest],
                                    context: RpcContext) -> pb.RepositoryModelUnloadResponse:
        async def handle(request: pb.RepositoryModelUnloadRequest) -> pb.RepositoryModelUnloadResponse:
            self._require_admin(context)
            self._plane.note_model(request.model_name)
            await self._control.run(UnloadModel(request.model_name))
            return pb.RepositoryModelUnloadResponse()
        return await self._scope.run("RepositoryModelUnload", context, incoming, handle, admin=True)

    def _require_admin(self, context: RpcContext) -> None:
        metadata = context.invocation_metadata() or ()
        # The HTTP admin routes' rule (api/access.py): the token, an operator key, a trusted loopback peer.
        rule = AccessRule(self._admin_token, self._trust_loopback_admin, self._scope.access.ring)
        rule.caller(metadata_value(metadata, "authorization"), metadata_value(metadata, "x-api-key"),
                    grpc_peer_host(context.peer()),
                    proxied=came_through_proxy(key for key, _ in metadata)).require_operator()
