"""A deadline on collectives: a stalled rank ends the job with a clear error.

Horovod's stall inspector shuts a job down only over MPI and only when
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` is set (over Gloo, in 0.28.1, never): a rank stuck in
user code leaves every other rank waiting forever. hvdp's watchdog is a thread in each process that knows when
this process waits in a collective: hvdp's own (the adapters wrap each wait in
:meth:`StallWatchdog.waiting`; waits inside TensorFlow's executor are counts it polls,
:meth:`StallWatchdog.poll`), and Horovod's module collectives that user code calls through
hvdp.torch / hvdp.keras (re-exported wrapped by :meth:`StallWatchdog.watched`). When a wait has
lasted half the deadline, it leaves a note on the failure board (``hvdp.cluster.failures``):
"rank r waits at <collective> since <time>". When it reaches the deadline, it reads every rank's
note, names the ranks that left none (they did not arrive) and those waiting at another
collective, reports that as this rank's failure and shuts Horovod down: the waiting ranks'
collectives fail at once, each with the watchdog's message, and a stalled rank that comes back
finds Horovod down and is told why by the board.

``HVDP_STALL_TIMEOUT_SECONDS``: the deadline (default 600; 0: off; raise it where a rank waits
longer for a reason). Without a board (``HVDP_FAILURE_BOARD=0``, MPI across hosts) the job still
ends, but the message cannot name the missing ranks.

Example::

    dog = StallWatchdog(timeout_s=600, get_rank=hvd.rank, get_size=hvd.size,
                        reporter=REPORTER, shutdown=hvd.shutdown)
    with dog.waiting("gradient reduction of optimizer 0"):
        hvd.synchronize(handle)        # past 600 s: StallError
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

from ..config import stall_timeout_s
from .failures import STALL_LINGER_S, settled
from .flight import RECORDER as FLIGHT
from .reports import SHUTDOWN_TEXT, is_consequence
from .stall_notes import StallNotes, describe

NOTE_AT = 0.5        # a wait this fraction of the deadline old leaves its note on the board
ENDING_AFTER_S = 1.0  # a wait this old looks on the board for a rank ending after its error
DOWN_WAIT_S = 30.0   # how long a failed wait waits for the watchdog's shutdown to return


class StallError(RuntimeError):
    """Some rank did not arrive at a collective within the deadline."""


def calls_inside(path_part: str) -> Tuple[Tuple[int, int, object], ...]:
    """The calls other threads are in now whose innermost Python frame's file has ``path_part``
    in its path (e.g. TensorFlow's directory: a traced step's call), each as (thread, id of the
    frame, its code): what :meth:`StallWatchdog.poll`'s ``read`` returns. Not the frames: the
    watchdog keeps the last ones it saw until its next look, and a frame kept past its call's
    return keeps its locals and its callers' alive (a dropped Keras model and optimizer,
    seen in a test that frees them). A frame's id is stable while its call is in progress."""
    me = threading.get_ident()
    return tuple((t, id(f), f.f_code) for t, f in sys._current_frames().items()
                 if t != me and path_part in f.f_code.co_filename)


class _Wait:
    __slots__ = ("name", "t0", "wall0", "noted", "begun", "calls")

    def __init__(self, name: str, t0: float, wall0: float):
        self.name, self.t0, self.wall0, self.noted = name, t0, wall0, False
        self.begun = 0   # a polled wait: the count of waits begun when it was seen,
        self.calls = ()  # and the calls then in progress that it may be part of


class StallWatchdog(StallNotes):
    """One per process (the adapters make it); a thread starts at the first wait.

    Args:
        timeout_s: the deadline of one wait; 0: off. None: from ``HVDP_STALL_TIMEOUT_SECONDS``.
        get_rank, get_size: this rank and the job's size (read while Horovod is up).
        reporter: the process's ``hvdp.cluster.failures.FailureReporter`` (its board, the notes),
            or None (no board: the message cannot name the missing ranks).
        shutdown: shuts Horovod down, so that every waiting collective fails.
        clock: monotonic seconds (tests pass a fake one and call :meth:`check` themselves).
    """

    def __init__(self, timeout_s: Optional[float], get_rank: Callable[[], int],
                 get_size: Callable[[], int], reporter, shutdown: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, start_thread: bool = True):
        # settings
        self._timeout = timeout_s
        self._get_rank, self._get_size = get_rank, get_size
        self._reporter, self._shutdown, self._clock = reporter, shutdown, clock
        self._start_thread = start_thread
        # internal state
        self._waits: Dict[int, _Wait] = {}  # thread -> its innermost wait (:meth:`waiting`)
        self._polled: Optional[Tuple[str, Callable[[], Tuple[int, int, Sequence[object]]]]] = None  # poll
        self._pwait: Optional[_Wait] = None
        self._plag = 0  # polled waits begun that will never end (failed steps): not waits
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._down = threading.Event()  # the watchdog's shutdown of Horovod returned
        self._since = time.time()       # an "ending" mark older than this watchdog is another job's
        self._ending_seen = False
        self._ending_done = threading.Event()  # its shutdown of Horovod (stop_waiting) returned
        self.message: Optional[str] = None   # set once the watchdog fired

    @property
    def timeout_s(self) -> float:
        if self._timeout is None:
            self._timeout = float(stall_timeout_s())  # HVDP_STALL_TIMEOUT_SECONDS; bad value: ValueError
        return self._timeout

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """Around one blocking wait of this process on a collective named ``name``. An error of
        the wait after the watchdog fired (Horovod shut down under it) becomes a ``StallError``.
        Waits of several threads are timed each; a wait inside another one (same thread) stands
        for it until it ends, and the outer one's deadline then starts again (it made progress)."""
        if self.timeout_s <= 0:
            yield
            return
        self._ensure_thread()
        tid = threading.get_ident()
        outer = self._waits.get(tid)
        w = self._waits[tid] = _Wait(name, self._clock(), time.time())
        try:
            yield
        except Exception as e:
            if self._ending_seen and self.message is None:
                # Horovod shut down here because another rank is ending (stop_waiting): not twice
                # at once (below); what the wait raised then ("Handle 7 was not created ...") is
                # the consequence, explained with that rank's report
                self._ending_done.wait(DOWN_WAIT_S)
                if is_consequence(e):
                    raise
                raise self._reporter.explained(RuntimeError(f"{SHUTDOWN_TEXT} (hvdp shut it down on this "
                                                            f"rank: {e})")) from e
            if self.message is None:
                raise
            # Horovod's shutdown joins its background thread unguarded: a second one at once (the
            # interpreter's exit, after this error) hung in pthread_join. Let the watchdog's return.
            self._down.wait(DOWN_WAIT_S)
            raise self._as_stall(e) from None  # what Horovod said after the shutdown adds nothing
        finally:
            last = self._waits.get(tid)  # w, or its restart after a wait inside it ended
            if outer is None:
                self._waits.pop(tid, None)
            else:
                self._waits[tid] = _Wait(outer.name, self._clock(), time.time())
            if w.noted or (last is not None and last.noted):  # a slow wait that finished: its
                self._put_note(None)                          # note no longer holds

    def watched(self, fn: Callable, label: Optional[str] = None,
                tracing: Callable[[], bool] = lambda: False) -> Callable:
        """``fn`` (a blocking collective of Horovod's module, as user code calls it), each call under
        :meth:`waiting` and in the flight record, named ``<label>(name='<its name argument>')``
        (``label``: ``hvd.<fn's name>``). ``tracing()``: True while a graph is traced (the call
        only adds an op to it, nothing waits: not timed). Two context managers per call.

        Example::

            allreduce = WATCHDOG.watched(horovod.torch.allreduce)
            allreduce(t, name="loss")  # a stall: StallError "... at hvd.allreduce(name='loss'): ..."
        """
        label = label or f"hvd.{fn.__name__}"
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        pos = params.index("name") if "name" in params else None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if tracing():
                return fn(*args, **kwargs)
            name = kwargs.get("name")
            if name is None and pos is not None and len(args) > pos:
                name = args[pos]
            what = label if name is None else f"{label}(name={name!r})"
            with self.waiting(what), FLIGHT.around(what, fn.__name__):  # also in the flight record
                return fn(*args, **kwargs)
        return call

    def poll(self, name: str, read: Callable[[], Tuple[int, int, Sequence[object]]]) -> None:
        """Waits that no Python call brackets (collectives inside TensorFlow's executor):
        ``read() -> (begun, ended, calls)``: how many such waits began and ended so far, and
        values that stand for the calls now in progress (compared by equality; :func:`calls_inside`
        makes them, and they must not be the calls' frames). A wait: ``begun``
        ahead of ``ended`` while one same call stays in progress (what a returned call left ahead,
        a failed step's count, is the new baseline)."""
        if self.timeout_s <= 0:
            return
        self._polled = (name, read)
        self._ensure_thread()

    def _polled_wait(self) -> Optional[_Wait]:
        if self._polled is None:
            return None
        name, read = self._polled
        try:
            begun, ended, calls = read()
        except Exception:  # e.g. TensorFlow going down at exit
            return None
        lead = begun - ended
        if not calls or lead < self._plag:  # nothing in progress: whatever is ahead was left by
            self._plag = lead                # failed steps (or a reset settled it)
        w = self._pwait
        if w is not None and (lead <= self._plag or w.begun != begun      # over, or another one,
                              or not any(c == d for c in w.calls for d in calls)):  # or returned
            if lead > self._plag and w.begun == begun:  # its call returned, its count never ends
                self._plag = lead
            self._pwait = None
            if w.noted:
                self._put_note(None)
            w = None
        if lead > self._plag and calls and w is None:
            w = self._pwait = _Wait(name, self._clock(), time.time())
            w.begun, w.calls = begun, tuple(calls)
        return w

    def _as_stall(self, e: Exception) -> "StallError":
        return settled(StallError(self.message))  # the failure reporter leaves it as it is

    def _ensure_thread(self) -> None:
        if self._thread is not None or not self._start_thread:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdp-stall-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while self.message is None:
            time.sleep(min(1.0, max(self.timeout_s / 20, 0.05)))
            try:
                self.check()
            except Exception:  # the watchdog must never take a healthy job down
                pass

    def check(self) -> bool:
        """One look at this process's wait; True when it fired (and shut Horovod down)."""
        if self.message is not None:
            return False
        waits = list(self._waits.values())
        polled = not waits
        w = self._polled_wait() if polled else min(waits, key=lambda x: x.t0)  # the oldest
        if w is None:
            return False
        waited = self._clock() - w.t0
        if waited >= ENDING_AFTER_S and not self._ending_seen:  # a rank ending after its error
            ending = self._reporter.ending_rank(self._since) if self._reporter is not None else None
            if ending is not None:
                self._ending_seen = True
                try:
                    self._reporter.stop_waiting(ending, w.name, self._shutdown)
                finally:
                    self._ending_done.set()
                return False
        if waited >= NOTE_AT * self.timeout_s and not w.noted:
            w.noted = True
            self._put_note(w)
        if waited < self.timeout_s or (not polled and all(x is not w for x in list(self._waits.values()))):
            return False  # (a wait that ended meanwhile)
        rank, size = int(self._get_rank()), int(self._get_size())
        notes = self.notes(size, since=w.wall0 - self.timeout_s)
        notes.setdefault(rank, {"name": w.name})
        self.message = describe(rank, w.name, self.timeout_s, size, notes, self._board() is not None)
        FLIGHT.dump(f"stall watchdog: {self.message}")  # before the shutdown changes anything
        try:
            self._reporter.report(StallError(self.message), "in hvdp's stall watchdog", STALL_LINGER_S)
            self._reporter.cause_here = f"StallError: {self.message}"
        except Exception:
            pass
        try:
            self._shutdown()
        except Exception:
            pass
        self._down.set()
        return True

