"""Stopping a run cleanly on Ctrl-C, SIGTERM and SIGHUP.

``kill``, ``timeout``, systemd and batch schedulers (SLURM's time limit and
``scancel``) stop a process with SIGTERM; a closed terminal sends SIGHUP.  Inside
:func:`stop_on_signals` both raise :class:`Interrupted`, a ``KeyboardInterrupt``, in
the main thread -- so every ``except KeyboardInterrupt`` that makes Ctrl-C save a
checkpoint handles them too.  :func:`deferred_interrupts` holds all three back while
a round commits (a run always stands at a completed round) and delivers them after.

Both restore the handlers they found: the library leaves no handler installed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Sequence

__all__ = ["Interrupted", "STOP_SIGNALS", "stop_on_signals", "deferred_interrupts", "exit_status",
           "signal_name"]

# the signals a run stops on besides SIGINT (SIGHUP does not exist on Windows)
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal other than SIGINT (``signum``: which one)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def signal_name(exc: BaseException) -> str:
    """The signal that stopped a run with ``exc``: ``"SIGTERM"``, ``"SIGHUP"``, or
    ``"SIGINT"`` for a plain ``KeyboardInterrupt`` (Ctrl-C)."""
    return exc.name if isinstance(exc, Interrupted) else signal.SIGINT.name


def exit_status(exc: BaseException) -> int:
    """The shell's status of a process stopped by ``exc``: ``128 + signum`` (130 for Ctrl-C)."""
    return 128 + (exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT))


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """While the block runs, each of ``signals`` (default SIGTERM and SIGHUP) raises
    :class:`Interrupted` in the main thread; the previous handlers are restored after.
    A signal the process was started with ignored (``nohup`` ignores SIGHUP) stays
    ignored.  Outside the main thread it does nothing."""
    installed = {}
    if _main_thread():
        for sig in signals:
            try:
                previous = signal.getsignal(sig)
                if previous == signal.SIG_IGN or previous is None:
                    continue
                signal.signal(sig, _raise_interrupted)
            except (ValueError, OSError):  # no signals here (embedded interpreter ...)
                continue
            installed[sig] = previous
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C), and SIGTERM / SIGHUP where a Python handler catches
    them (:func:`stop_on_signals`), until the block is done; then deliver the first one
    received to the handler that was in place (SIGINT under the default action raises
    ``KeyboardInterrupt``; an ignored one is dropped)."""
    if not _main_thread():
        yield
        return
    received = []
    saved = {}
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        try:
            previous = signal.getsignal(sig)
            if sig != signal.SIGINT and not callable(previous):
                continue  # the default action (die) or ignored: not ours to defer
            signal.signal(sig, lambda signum, frame: received.append(signum))
        except (ValueError, OSError):
            continue
        saved[sig] = previous
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        if received:
            sig = received[0]
            previous = saved[sig]
            if callable(previous):
                previous(sig, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
