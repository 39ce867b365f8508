"""gRPC server reflection under both of its names.

`grpc.reflection.v1` is the protocol's current name, the one grpcurl, buf
curl and Postman ask first (some clients ask nothing else);
grpcio-reflection implements only the older `grpc.reflection.v1alpha`. The
two are the same messages, field for field, in another package, so the v1
method is the v1alpha servicer behind the same (de)serializers, and the v1
file's descriptor (v1alpha's with its package renamed) is put in the
default pool, for a client that resolves the v1 service by reflection, as
it does every service it lists.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_OLD, _NEW = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def _add_v1_descriptor() -> None:
    """v1's reflection.proto in the default pool (once per process)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")  # v1alpha's Java/C# package names
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message's field (a scalar has none: setting one is an error)
                field.type_name = field.type_name.replace(_OLD, _NEW)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_OLD, _NEW)
            method.output_type = method.output_type.replace(_OLD, _NEW)
    pool.AddSerializedFile(proto.SerializeToString())


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection of `service_names` (and of itself, under both names) on `server`."""
    _add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),))
