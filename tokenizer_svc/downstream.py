"""The connection to the scheduler, and the transport choice for tensors.

Shared memory is used only when the scheduler's shared-memory namespace id
equals ours (same kernel boot, same /dev/shm) and it accepts our segment
prefix; otherwise tensors travel inline. A transport failure of the call is
SCHEDULER_UNAVAILABLE (retriable); the scheduler's own errors are relayed
with their codes unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc

from mmsplit import shm
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, RemoteError
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from mmsplit.serving import ClientSecurity
from tokenizer_svc.errors import SchedulerUnavailable
from tokenizer_svc.settings import TokenizerSettings

log = logging.getLogger(__name__)
RECONNECT_INITIAL_MS = 250
RECONNECT_MAX_MS = 2000


class SchedulerLink:
    def __init__(self, settings: TokenizerSettings, security: ClientSecurity) -> None:
        self.settings = settings
        # Requests may carry inline tensors (the scheduler enforces its own
        # limit on them); its responses are small. A scheduler that comes back
        # (restarted, rescheduled) is found within RECONNECT_MAX_MS: gRPC's
        # default backoff grows to 120 s, which would keep this tokenizer
        # NOT_SERVING for minutes after its scheduler is back.
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
        ]
        self.channel = security.channel(settings.scheduler, options)
        self._metadata = security.metadata()
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.info: common_pb2.ServerInfo | None = None
        self.transport = common_pb2.TRANSPORT_UNSPECIFIED
        self._namespace = shm.namespace_id()

    @property
    def connected(self) -> bool:
        return self.info is not None

    async def refresh(self, timeout_s: float = 2.0) -> bool:
        """Ask the scheduler to describe itself; choose the transport. False
        (and disconnected) when it does not answer."""
        try:
            reply = await self.stub.GetServerInfo(
                scheduler_pb2.GetServerInfoRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if self.info is not None:
                log.warning("scheduler %s stopped answering: %s", self.settings.scheduler, exc.code())
            self.info = None
            return False
        info = reply.info
        same_memory = info.shm_namespace == self._namespace and info.shm_prefix == self.settings.shm_prefix
        transport = (
            common_pb2.TRANSPORT_SHM
            if same_memory and common_pb2.TRANSPORT_SHM in info.transports
            else common_pb2.TRANSPORT_INLINE
        )
        if self.info is None or transport != self.transport:
            log.info(
                "scheduler %s: model %s, tp %d; tensors go by %s",
                self.settings.scheduler,
                info.model,
                info.tp_size,
                common_pb2.Transport.Name(transport),
            )
        self.info, self.transport = info, transport
        return True

    async def wait_connected(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.refresh():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.5)
        return True

    async def generate(
        self, request: scheduler_pb2.GenerateRequest, *, timeout_s: float | None
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        call = self.stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            error = RemoteError.from_rpc_error(exc, unavailable_code=E.ERROR_CODE_SCHEDULER_UNAVAILABLE)
            if error.error_code == E.ERROR_CODE_SCHEDULER_UNAVAILABLE:
                self.info = None
                log.warning("scheduler %s: %s %s", self.settings.scheduler, exc.code(), exc.details())
                raise SchedulerUnavailable("the scheduler is unavailable; retry shortly") from exc
            raise error from exc
        finally:
            call.cancel()  # no-op when the call already ended; aborts it downstream otherwise

    async def close(self) -> None:
        await self.channel.close()
