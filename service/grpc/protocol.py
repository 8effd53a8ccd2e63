"""The function Ray Serve's gRPC options name (`grpc_servicer_functions`), as generated code's
`add_..._to_server` would be named: every proxy and replica calls it to learn the methods. It registers
every API's gRPC service (service/apis; today KServe v2's, service/apis/kserve_v2/grpc.py)."""

from __future__ import annotations

import grpc

SERVICER_FUNCTION = "service.grpc.protocol:add_inference_servicer_to_server"


def add_inference_servicer_to_server(servicer, server) -> None:
    """Register the unary methods of every API's gRPC service, answered by `servicer` (Serve passes its
    own), on `server`."""
    from service.grpc.servicer import grpc_services

    for service in grpc_services():
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=method.request.FromString,
                response_serializer=method.response.SerializeToString,
            )
            for name, method in service.methods.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.name, handlers),))
