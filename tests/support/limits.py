"""The open-file limit as the tests start services with it: low, as some
container runtimes do, so that what a service raises it to (and what its
children inherit) shows."""

from __future__ import annotations

import resource

from mmsplit_server.serving import WANT_OPEN_FILES

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
# What a service raises its soft limit to here (it cannot pass the hard one).
RAISED = WANT_OPEN_FILES if HARD == resource.RLIM_INFINITY else min(WANT_OPEN_FILES, HARD)
LOW = 512


def started_low() -> list[str]:
    """A command prefix that runs a service with a soft limit of `LOW`."""
    hard = "unlimited" if HARD == resource.RLIM_INFINITY else str(HARD)
    return ["prlimit", f"--nofile={min(LOW, HARD)}:{hard}", "--"]


def nothing_to_raise() -> str:
    """Why a test of the raise is skipped here, or "" when it is not."""
    return f"the hard limit here ({HARD}) leaves nothing to raise" if RAISED <= LOW else ""
