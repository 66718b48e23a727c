"""The flight record's signals (``hvdp.cluster.flight``): a dump on SIGUSR1 (on request; the
process goes on) and on SIGTERM (what horovodrun sends the survivors once one rank has exited),
also while the main thread blocks in a collective.

Python runs signal handlers on the main thread between bytecodes only; a rank blocked in a
collective would never dump. So the handlers also wake a thread through ``signal.set_wakeup_fd``,
and that thread writes the dump (and, for SIGTERM over its default, ends the process saying why).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Dict, Optional

SIGNALS = ("SIGUSR1", "SIGTERM")


class SignalDumps:
    """Mixed into ``FlightRecorder``, which provides ``capacity``, ``dump(reason)``,
    ``ended_message(signame, path)`` and ``_after_fork()``."""

    def _init_signals(self) -> None:
        self._previous: Dict[int, object] = {}     # signal number -> the handler before ours
        self._watcher: Optional[threading.Thread] = None
        self._wakeup: Optional[int] = None         # the write end of the watcher's pipe

    def install_signals(self) -> bool:
        """Dump on SIGUSR1 and SIGTERM, then hand the signal to the handler that was there before
        (SIGTERM's default still ends the process, as it would have; SIGUSR1's default, which
        would end it, is replaced by the dump alone). A handler set later by the user or a
        library replaces ours: it is not undone. The main thread only runs Python handlers
        between bytecodes, so while it blocks in a collective a thread woken by
        ``signal.set_wakeup_fd`` writes the dump (where no other wake-up fd is set). Main thread
        only; idempotent; -> whether the handlers are ours."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return bool(self._previous)
        try:
            if self.capacity <= 0:
                return False
            for name in SIGNALS:
                num = getattr(signal, name, None)
                # None: a handler set outside Python (a C library's), which could not be restored
                if num is not None and signal.getsignal(num) is not None:
                    self._previous[num] = signal.signal(num, self._on_signal)
        except (ValueError, OSError):  # not the main interpreter, or a platform without them
            return bool(self._previous)
        self._start_watcher()
        return True

    def _start_watcher(self) -> None:
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError, AttributeError):
            return
        if old != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._wakeup = w
        self._watcher = threading.Thread(target=self._watch, args=(r,), name="hvdp-flight-signals",
                                         daemon=True)
        self._watcher.start()
        os.register_at_fork(after_in_child=self._after_fork)

    def _detach_signals(self) -> None:
        """In a forked child: its signals must not reach the parent's watcher through the
        inherited pipe (a worker's SIGTERM would end the parent)."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._wakeup)
            os.close(null)
        except (OSError, TypeError):
            pass
        self._watcher = None

    def _watch(self, fd: int) -> None:
        ours = {int(n): name for name in SIGNALS for n in [getattr(signal, name, None)] if n is not None}
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for num in data:
                if num in ours:
                    path = self.dump(f"signal {ours[num]}")
                    if (ours[num] == "SIGTERM" and self._previous.get(num) == signal.SIG_DFL
                            and signal.getsignal(num) == self._on_signal):  # not replaced since
                        # what SIGTERM's default would have done, without waiting for the main
                        # thread (it may be blocked in a collective): end the process now, saying why
                        try:
                            os.write(2, (self.ended_message("SIGTERM", path) + "\n").encode())
                        except Exception:
                            pass
                        os._exit(128 + num)

    def _on_signal(self, num, frame) -> None:
        if self._watcher is None:
            self.dump(f"signal {signal.Signals(num).name}")
        prev = self._previous.get(num)
        if callable(prev):
            prev(num, frame)
        elif prev == signal.SIG_DFL and num == signal.SIGTERM:
            if self._watcher is not None:
                time.sleep(2.0)  # the watcher thread dumps, then ends the process
            signal.signal(num, signal.SIG_DFL)
            os.kill(os.getpid(), num)
