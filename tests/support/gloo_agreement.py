"""One rank of the real two-process gloo agreement test.

    python -m tests.support.gloo_agreement RANK PORT CODE [CODE ...]

Prints the agreed failures and active counts as one JSON line, and what
two plan broadcasts delivered: one that fits a single buffer, one (of inline
pixels' size) that needs a second broadcast.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from scheduler_svc.agreement import agree_on_failures
from scheduler_svc.collective import TorchCollective


def main() -> None:
    rank, port, codes = int(sys.argv[1]), sys.argv[2], [int(c) for c in sys.argv[3:]]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        coll = TorchCollective(torch.device("cpu"))
        messages = [f"rank {rank} failed {i}" if c else "" for i, c in enumerate(codes)]
        failed, active = agree_on_failures(coll, codes, messages, active=rank + 1)
        small = coll.broadcast_from_0({"step": 7, "feed": [("a", 1)]} if rank == 0 else None)
        large = coll.broadcast_from_0(bytes(range(256)) * 1000 if rank == 0 else None)
        print(
            json.dumps(
                {
                    "small": small,
                    "large_ok": large == bytes(range(256)) * 1000,
                    "active": active,
                    "failed": {
                        str(i): [f.code, list(f.ranks), {str(r): m for r, m in f.messages.items()}]
                        for i, f in failed.items()
                    },
                }
            )
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
