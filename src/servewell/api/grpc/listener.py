"""The gRPC listener: a `grpc.aio` server on the frontend's event loop."""

from __future__ import annotations

import logging

import grpc
from tritonclient.grpc import service_pb2_grpc

from servewell.api.grpc.servicer import InferenceServicer

log = logging.getLogger("servewell.api")


class GrpcListener:
    """Serves `InferenceServicer` on `host:port` until stopped."""

    def __init__(self, servicer: InferenceServicer, host: str, port: int, max_message_bytes: int,
                 max_concurrent_rpcs: int) -> None:
        self._servicer = servicer
        self._address = f"{host}:{port}"
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ]
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and start serving; `OSError` when the port cannot be bound."""
        server = grpc.aio.server(options=self._options, maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self._servicer, server)
        try:
            bound = server.add_insecure_port(self._address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {self._address}: {exc}") from None
        if not bound:
            raise OSError(f"cannot listen for gRPC on {self._address} (in use?); set --grpc-port, or 0 to turn it off")
        await server.start()
        self._server = server
        log.info("gRPC (OIP v2) listening on %s", self._address)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; calls in flight get `grace_s` seconds to finish."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
