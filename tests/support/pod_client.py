"""A client a test runs inside a pod's network namespace (where its own
process cannot reach): ``python -m tests.support.pod_client ADDRESS SPEC
[KEEPALIVE_S]`` (the client's keepalive, 1 s to answer a ping; its default without).

SPEC is JSON: a list of {"request_id", "max_tokens", "image": bool}. The
requests run at once through `mmsplit.client.Client` (no retries). Stdout
gets one JSON line per event the test may wait for: {"started": id} at a
request's first token, then {"request_id", "ok", "reason",
"completion_tokens"} when it ends."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmsplit.client import Client, Delta, RequestFailed
from mmsplit_cli import samples

_print_lock = threading.Lock()


def say(obj: dict[str, Any]) -> None:
    with _print_lock:
        print(json.dumps(obj), flush=True)


def one(client: Client, spec: dict[str, Any]) -> None:
    rid = spec["request_id"]
    images = [samples.good_png(seed=len(rid))] if spec.get("image") else []
    tokens = 0
    try:
        for event in client.generate(
            "Go on.",
            images=images,
            max_tokens=spec["max_tokens"],
            min_tokens=spec["max_tokens"],
            request_id=rid,
            timeout=120,
        ):
            if isinstance(event, Delta) and event.token_ids:
                if tokens == 0:
                    say({"started": rid})
                tokens += len(event.token_ids)
        say({"request_id": rid, "ok": True, "reason": "", "completion_tokens": tokens})
    except RequestFailed as exc:
        say({"request_id": rid, "ok": False, "reason": exc.reason, "completion_tokens": tokens})


def main() -> None:
    address, specs = sys.argv[1], json.loads(sys.argv[2])
    # The test's keepalive: a ping every KEEPALIVE_S, a second to answer it.
    keepalive = {"keepalive_s": float(sys.argv[3]), "keepalive_timeout_s": 1.0} if len(sys.argv) > 3 else {}
    with Client(address, retries=0, **keepalive) as client, ThreadPoolExecutor(len(specs)) as pool:
        list(pool.map(lambda spec: one(client, spec), specs))


if __name__ == "__main__":
    main()
