"""gRPC server plumbing both services share: health, reflection, binding, logging."""

from __future__ import annotations

import logging
import socket
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for rendezvous and test servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s",
    )


class Health:
    """grpc.health.v1 for one service: "" reports liveness (SERVING while the
    process serves at all), the full service name reports readiness."""

    def __init__(self, service_name: str) -> None:
        self.service_name = service_name
        self.servicer = health.aio.HealthServicer()
        self._ready = False

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self.servicer.set(self.service_name, NOT_SERVING)

    async def set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            log.info("%s readiness: %s", self.service_name, "SERVING" if ready else "NOT_SERVING")
        self._ready = ready
        await self.servicer.set(self.service_name, SERVING if ready else NOT_SERVING)


async def new_server(
    *,
    host: str,
    port: int,
    health_: Health,
    service_names: list[str],
    max_message_bytes: int,
) -> tuple[grpc.aio.Server, int]:
    """A server with health and reflection registered; returns it and its bound
    port (`port` 0 picks a free one). The caller adds its servicers first via
    the returned server, then starts it."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound
