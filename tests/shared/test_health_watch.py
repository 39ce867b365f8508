"""grpc.health.v1 Watch on our servers (mmsplit_server.serving.Health): a
watch follows readiness, and ends with status OK when the server is about
to stop (`Health.stopping`), rather than being cut off by the stop's end of
grace, which gRPC logs at ERROR with a CancelledError traceback; a watch
asked for after that ends at once, after its one status; Check answers as
before."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmsplit_server.serving import NOT_SERVING, SERVING, Health, new_server
from tests.support.cycles import server_calls_ended, uncollected

SERVICE = "mmsplit.test.v1.Test"


def test_a_watch_follows_readiness_and_ends_ok_when_the_server_stops() -> None:
    async def run() -> tuple[list[int], grpc.StatusCode, list[int], grpc.StatusCode]:
        health = Health(SERVICE)
        await health.start()
        server, port = await new_server(
            host="127.0.0.1", port=0, health_=health, service_names=[SERVICE], max_message_bytes=1 << 20
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
                assert (await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == NOT_SERVING
                seen = [(await watch.read()).status]
                await health.set_ready(True)
                seen.append((await watch.read()).status)
                await health.stopping()
                while (more := await watch.read()) is not grpc.aio.EOF:  # nothing more: the stream ends
                    seen.append(more.status)
                code = await watch.code()
                late = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
                after = [r.status async for r in late]
                return seen, code, after, await late.code()
        finally:
            await server.stop(1.0)

    seen, code, after, late_code = asyncio.run(asyncio.wait_for(run(), 30))
    assert seen == [NOT_SERVING, SERVING]
    assert code == grpc.StatusCode.OK
    assert after == [SERVING]  # its one status, then the end
    assert late_code == grpc.StatusCode.OK


def test_a_check_of_a_service_it_does_not_serve_is_not_found_and_leaves_no_frame() -> None:
    """As the health protocol has it, NOT_FOUND; aborted as our other unary
    refusals are (`serving.abort`), so that nothing but grpc.aio's own
    call state waits for the collector."""

    async def run() -> tuple[list[grpc.StatusCode], list[str]]:
        health = Health(SERVICE)
        await health.start()
        server, port = await new_server(
            host="127.0.0.1", port=0, health_=health, service_names=[SERVICE], max_message_bytes=1 << 20
        )
        await server.start()
        codes: list[grpc.StatusCode] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with uncollected() as found:
                    for _ in range(3):
                        try:
                            await stub.Check(health_pb2.HealthCheckRequest(service="mmsplit.test.v1.Other"))
                        except grpc.aio.AioRpcError as refused:
                            codes.append(refused.code())
                    await server_calls_ended()
                return codes, found
        finally:
            await server.stop(1.0)

    codes, found = asyncio.run(asyncio.wait_for(run(), 30))
    assert codes == [grpc.StatusCode.NOT_FOUND] * 3
    assert set(found) <= {"AbortError"}, found  # no frame, no request
