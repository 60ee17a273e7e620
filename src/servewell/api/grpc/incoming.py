"""The request message of a gRPC call, read only when the call's scope asks for it: after the API
key was checked, within a receive deadline (as HTTP's body timeout), parsed by servewell so that
a malformed message is INVALID_ARGUMENT rather than grpcio's UNKNOWN."""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from servewell.errors import ClientClosed, InvalidInput, ServeError

M = TypeVar("M")


class ReceiveTimeout(ServeError):
    """The request message did not arrive complete within the receive deadline (DEADLINE_EXCEEDED)."""

    status, code = 408, "receive_timeout"


class CallUnimplemented(ServeError):
    """A call servewell does not serve (UNIMPLEMENTED)."""

    status, code = 501, "unimplemented"


class CallLimitReached(ServeError):
    """Every call slot is held (RESOURCE_EXHAUSTED, with a retry-after trailer)."""

    status, code = 429, "too_many_calls"


class IncomingMessage(Generic[M]):
    """One call's request message, not yet read."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], message_type: type[M],
                 timeout_s: float) -> None:
        self._context = context
        self._type = message_type
        self._timeout_s = timeout_s

    async def receive(self) -> M:
        """The message; `ReceiveTimeout` when it is not complete within the deadline,
        `InvalidInput` when it is missing or not a valid protobuf of the call's type."""
        try:
            async with asyncio.timeout(self._timeout_s):
                data = await self._context.read()
        except TimeoutError:
            raise ReceiveTimeout(f"the request message did not arrive complete within {self._timeout_s:g} s "
                                 "(grpc_receive_timeout_s)") from None
        if not isinstance(data, bytes):
            # grpc.aio.EOF: the client went away (1,200 attack calls at once when its connections
            # closed), or half-closed without a message, which no unary client does.
            raise ClientClosed("the call ended before its request message was complete")
        parse: Any = self._type
        try:
            return parse.FromString(data)  # type: ignore[no-any-return]
        except DecodeError:
            raise InvalidInput(f"the request message is not a valid {parse.DESCRIPTOR.full_name} protobuf") from None
