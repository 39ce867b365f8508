"""One rank of the real two-process gloo agreement test.

    python -m tests.support.gloo_agreement RANK PORT CODE [CODE ...]

Prints the agreed failures and active counts as one JSON line.
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
        print(
            json.dumps(
                {
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
