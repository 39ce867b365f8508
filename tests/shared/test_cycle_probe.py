"""tools/cycle_probe.py: a first SIGUSR1 turns the collector off, a second
reports what only a collection freed (by type, frame and exception)."""

from __future__ import annotations

import gc
import signal

import pytest

from tools import cycle_probe


def _failing_and_kept() -> None:
    """A failure whose traceback holds this frame, which holds the failure."""
    try:
        raise ValueError("kept")
    except ValueError as exc:
        kept = exc  # noqa: F841  (the cycle: exc -> traceback -> this frame -> kept -> exc)


def test_two_signals_report_the_cycles_made_between_them(capsys: pytest.CaptureFixture[str]) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, cycle_probe._report)
        cycle_probe._rounds["armed"] = False
        signal.raise_signal(signal.SIGUSR1)
        assert not gc.isenabled()
        _failing_and_kept()
        signal.raise_signal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gc.enable()
    err = capsys.readouterr().err
    assert "the collector is off" in err
    assert "_failing_and_kept:" in err, err
    assert "('ValueError', 1)" in err, err
