"""The TrajectoryStore method-handler table a server registers (services/store/server.py):
the generated one, with Pull / PullChunks sending pre-serialized bytes and every request
parsed by the handler itself (a bad one is INVALID_ARGUMENT, not INTERNAL)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.pb.r3flow.v1 import store_pb2, store_pb2_grpc

SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].full_name


class _HandlerCapture:
    """Stands in for a grpc.Server to capture the generated method-handler table."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def _parsing(method: str, handler: Any) -> Any:
    """`handler` taking raw bytes and parsing them itself: gRPC's own deserializer answers an
    unparseable request with INTERNAL; this answers INVALID_ARGUMENT naming the message type."""
    deserialize = handler.request_deserializer
    name = store_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].methods_by_name[
        method].input_type.name

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            raise ValueError(f"{name}: not a valid serialized {name} ({e})") from None

    def parse_or_abort(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return parse(raw)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def unary_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from handler.unary_stream(parse_or_abort(raw, context), context)

    if handler.request_streaming:  # Append: a ValueError from the iterator -> INVALID_ARGUMENT
        return handler._replace(request_deserializer=None, stream_unary=lambda it, ctx:
                                handler.stream_unary(map(parse, it), ctx))
    if handler.response_streaming:
        return handler._replace(request_deserializer=None, unary_stream=unary_stream)
    return handler._replace(request_deserializer=None, unary_unary=lambda raw, ctx:
                            handler.unary_unary(parse_or_abort(raw, ctx), ctx))


def add_servicer(servicer: store_pb2_grpc.TrajectoryStoreServicer, server: grpc.Server) -> None:
    """The generated registration, except that Pull and PullChunks send pre-serialized
    PulledGroup / PulledPart bytes (stored payloads are spliced, not parsed and re-serialized;
    services/store/assemble.py)."""
    capture = _HandlerCapture()
    store_pb2_grpc.add_TrajectoryStoreServicer_to_server(servicer, capture)  # type: ignore[arg-type]
    handlers = capture.handlers
    for name in ("Pull", "PullChunks"):
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=store_pb2.PullRequest.FromString,
            response_serializer=None)
    handlers = {name: _parsing(name, h) for name, h in handlers.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
