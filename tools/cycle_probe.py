"""Run an mmsplit service and count what only the garbage collector would
free: the reference cycles its requests leave (docs/development.md,
"Reference cycles on failure paths").

    python tools/cycle_probe.py tokenizer --model DIR --scheduler HOST:PORT ...
    kill -USR1 PID    # the collector off from here
    ... send it a storm of every kind of request ...
    kill -USR1 PID    # one collection: what it found goes to stderr

Any `mmsplit` command line works (the arguments after this script's name).
The second signal prints the garbage by type, the frames in it by function
and line, and the exceptions, then turns the collector off again for the
next round. A probe, not for production: the collector stays off between
the signals."""

from __future__ import annotations

import collections
import gc
import signal
import sys
from types import FrameType

_rounds = {"armed": False}


def _report(signum: int, frame: FrameType | None) -> None:
    if not _rounds["armed"]:
        gc.collect()
        gc.disable()
        _rounds["armed"] = True
        print("cycle_probe: the collector is off; signal again to collect", file=sys.stderr, flush=True)
        return
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    garbage = list(gc.garbage)
    gc.set_debug(0)
    gc.garbage.clear()
    by_type = collections.Counter(type(o).__name__ for o in garbage)
    frames = collections.Counter(f"{o.f_code.co_qualname}:{o.f_lineno}" for o in garbage if isinstance(o, FrameType))
    errors = collections.Counter(type(o).__name__ for o in garbage if isinstance(o, BaseException))
    print(f"cycle_probe: {len(garbage)} objects in cycles: {by_type.most_common(20)}", file=sys.stderr)
    print(f"cycle_probe: frames: {frames.most_common(40)}", file=sys.stderr)
    print(f"cycle_probe: exceptions: {errors.most_common(20)}", file=sys.stderr, flush=True)
    del garbage
    gc.collect()  # what was found, freed now that nothing saves it
    gc.disable()


def main() -> None:
    signal.signal(signal.SIGUSR1, _report)
    sys.argv = ["mmsplit", *sys.argv[1:]]
    from mmsplit_cli.main import main as mmsplit

    mmsplit()


if __name__ == "__main__":
    main()
