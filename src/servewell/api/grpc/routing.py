"""Which handler serves each gRPC method: every unary call of `inference.GRPCInferenceService` that
`InferenceServicer` implements, as a request-streaming handler of raw bytes so that the servicer
reads (and parses) the message itself, after the key check and within a receive deadline; every
other method, known or not, is answered UNIMPLEMENTED quietly after the key check (grpcio's base
servicer raised NotImplementedError: an ERROR with a traceback per call, 500 calls -> 563 KB of log)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from servewell.api.grpc.connection_eviction import CallPeers, peer_address
from servewell.api.grpc.incoming import IncomingMessage
from servewell.api.grpc.scope import RpcContext, RpcScope

SERVICE = "inference.GRPCInferenceService"
_METHODS = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name

#: A servicer method: the call's incoming message and context in, the response out.
Behaviour = Callable[[IncomingMessage[Any], RpcContext], Awaitable[Any]]


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


class ServiceRouter(grpc.GenericRpcHandler):
    """The one generic handler of the gRPC server; it tells `calls` which connections have calls
    (by their peer), so that the connection sweep knows which never opened one."""

    def __init__(self, servicer: object, scope: RpcScope, receive_timeout_s: float,
                 calls: CallPeers | None = None) -> None:
        self._scope = scope
        self.calls = calls if calls is not None else CallPeers()
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for name, method in _METHODS.items():
            behaviour = getattr(servicer, name, None)
            if behaviour is None or method.client_streaming or method.server_streaming:
                continue
            request_type = getattr(pb, method.input_type.name)
            self._handlers[f"/{SERVICE}/{name}"] = grpc.stream_unary_rpc_method_handler(
                _bind(behaviour, request_type, receive_timeout_s, self.calls), response_serializer=_serialize)
        stream_infer = getattr(servicer, "ModelStreamInfer", None)
        if stream_infer is not None:  # bidirectional: it reads its messages itself (api/grpc/stream_infer.py)
            self._handlers[f"/{SERVICE}/ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
                _counted(stream_infer, self.calls), response_serializer=_serialize)
        self._unimplemented: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
            _counted(self._refuse, self.calls))

    @property
    def methods(self) -> list[str]:
        """The methods served (full names)."""
        return sorted(self._handlers)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        method: str | bytes = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode("utf-8", "replace")
        return self._handlers.get(method, self._unimplemented)

    async def _refuse(self, request_iterator: object, context: RpcContext) -> None:
        await self._scope.unimplemented(context)


def _bind(behaviour: Behaviour, request_type: type[Any], timeout_s: float,
          calls: CallPeers) -> Callable[[object, RpcContext], Awaitable[Any]]:
    async def handle(request_iterator: object, context: RpcContext) -> Any:
        # Counted here rather than by wrapping (as `_counted` does): one coroutine less per call.
        address = peer_address(context.peer())
        if address is not None:
            calls.started(address)
        try:
            return await behaviour(IncomingMessage(context, request_type, timeout_s), context)
        finally:
            if address is not None:
                calls.ended(address, time.monotonic())
    return handle


def _counted(handle: Callable[[object, RpcContext], Awaitable[Any]],
             calls: CallPeers) -> Callable[[object, RpcContext], Awaitable[Any]]:
    """`handle`, telling `calls` when a call starts and ends on its connection."""
    async def counted(request_iterator: object, context: RpcContext) -> Any:
        address = peer_address(context.peer())
        if address is None:
            return await handle(request_iterator, context)
        calls.started(address)
        try:
            return await handle(request_iterator, context)
        finally:
            calls.ended(address, time.monotonic())
    return counted
