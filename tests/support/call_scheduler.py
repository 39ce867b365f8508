"""Call a scheduler with chosen credentials and print what happened, one
JSON line (run inside a test's network namespace):

    python -m tests.support.call_scheduler ADDRESS [--token T | --local] [--ca F [--cert F --key F] [--server-name N]]

(`--local`: the scheduler's local token, as a client of this user finds it, `mmsplit.localauth`.)

Prints {"info": code, "generate": code, "health": status, "reason": ErrorInfo reason or ""}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmsplit import localauth
from mmsplit.common.v1 import common_pb2
from mmsplit.errors import error_info_of
from mmsplit.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--token", default="")
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--ca", default="")
    parser.add_argument("--cert", default="")
    parser.add_argument("--key", default="")
    parser.add_argument("--server-name", default="")
    args = parser.parse_args()
    if args.ca:
        creds = grpc.ssl_channel_credentials(
            Path(args.ca).read_bytes(),
            Path(args.key).read_bytes() if args.key else None,
            Path(args.cert).read_bytes() if args.cert else None,
        )
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(args.address, creds, options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    if args.local:
        metadata = localauth.LocalToken(args.address).metadata()
    out: dict[str, str] = {"reason": ""}
    with channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            stub.GetServerInfo(scheduler_pb2.GetServerInfoRequest(), timeout=10, metadata=metadata)
            out["info"] = "OK"
        except grpc.RpcError as exc:
            out["info"] = exc.code().name  # type: ignore[attr-defined]
            detail = error_info_of(exc)
            out["reason"] = detail.reason if detail else ""
        request = scheduler_pb2.GenerateRequest(
            request_id="call-1", input_ids=[1, 22557, 1526], sampling=common_pb2.SamplingParams(max_tokens=3)
        )
        try:
            list(stub.Generate(request, timeout=30, metadata=metadata))
            out["generate"] = "OK"
        except grpc.RpcError as exc:
            out["generate"] = exc.code().name  # type: ignore[attr-defined]
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            out["health"] = exc.code().name  # type: ignore[attr-defined]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
