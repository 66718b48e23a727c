"""When one rank fails, the others say which rank and what it raised.

Horovod tells the survivors only "Horovod has been shut down": the failing rank's exception is
in its own log, which on a cluster may be on another host. So the failing rank leaves a short
report on a *board* before Horovod shuts down (its exception hook runs before the interpreter's
exit handlers, and Horovod's shutdown is one of those), and a survivor whose collective failed
reads the board and names the cause.

Boards (``hvdp.cluster.boards``): with Gloo, the key-value store horovodrun already serves to every
worker for its rendezvous (any host); otherwise a private directory (0700, owner checked) in the temporary
directory, named after the user and the MPI job, which only ranks on the same host share. No
board, or a rank killed without a chance to write (SIGKILL, OOM killer), or a stall shutdown by
Horovod's inspector: the survivor says that nobody reported (hvdp's own stall watchdog reports,
``hvdp.cluster.watchdog``).
``HVDP_FAILURE_BOARD=0`` turns the reports off.

The launcher stops every other worker as soon as the failing one exits, which can be before a
survivor has printed its explanation. So a rank that failed with an uncaught error shuts Horovod
down itself (the survivors' collectives fail at once) and then *lingers*: it waits, at most
``linger_s``, until every other rank has left a "done" mark on the board (a survivor marks after
its exception hook has printed; a rank that failed itself marks when it reports).

Example::

    reporter = FailureReporter(get_rank=hvd.rank)
    reporter.install()                      # uncaught errors are reported, survivors explain
    try:
        reduce()
    except Exception as e:
        raise reporter.explained(e) from e  # same type, with "rank 1 failed first: ..." added
    with reporter.explaining():             # the same, as a context
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

from .boards import board_from_env
from .ending import EndingMarks
from .exits import meet_within
from .flight import RECORDER as FLIGHT
from .reports import explain, is_consequence, make_report, parse_reports
from ..config import elastic_mode

LINGER_S = 15.0         # the adapters' default linger of a failed rank (not elastic): longer than a
                        # survivor's own way out when the shutdown does not reach it (its watchdog
                        # looks after a 1 s wait, then its shutdown gets 10 s: hvdp.cluster.ending);
                        # with 3 s the launcher once killed such a survivor before it spoke
STALL_LINGER_S = 3.0    # ... after a stall: the ranks named did not arrive, and rarely say more
SHUTDOWN_S = 20.0       # a failed rank's own Horovod shutdown not back by then is stuck: the process
                        # ends (seen once under MPI: the job hung until its launcher was killed)
DONE_SLACK_S = 30       # a "done" mark this much older than the failing rank's report is stale


def settled(exc: BaseException) -> BaseException:
    """Mark ``exc`` as reported and explained already (its message names the cause, e.g. the
    stall watchdog's): the reporter neither reports nor explains it again. -> ``exc``."""
    exc._hvdp_reported = True
    exc._hvdp_explained = True
    return exc


class FailureReporter(EndingMarks):
    """Reports this rank's failures and explains the others'. One per process (see ``install``).

    Args:
        get_rank: this rank in the job (Horovod's global rank); read while Horovod is up.
        board: where reports go; default from the environment (:func:`board_from_env`).
        wait_s: how long a survivor looks for a report before saying none came. The failing
            rank writes before it shuts Horovod down, so the report is normally there at once.
        get_size: the job's size (read at ``install``); without it a failing rank does not linger.
        shutdown: shuts Horovod down (a failing rank calls it before it lingers).
        linger_s: how long a rank whose uncaught error was reported waits for the others' "done"
            marks before it exits (0: no wait; elastic jobs reset instead of stopping).
        shutdown_s: how long that rank's own call of ``shutdown`` may take before it is taken as
            stuck and the process ends at once (``os._exit(1)``, after saying so), so that the
            launcher stops the others instead of the job hanging.
    """

    def __init__(self, get_rank: Callable[[], int], board=None, wait_s: float = 1.0,
                 get_size: Optional[Callable[[], int]] = None,
                 shutdown: Optional[Callable[[], None]] = None, linger_s: float = 0.0,
                 shutdown_s: float = SHUTDOWN_S):
        # settings
        self._get_rank, self._board, self.wait_s = get_rank, board, wait_s
        self._get_size, self._shutdown, self.linger_s = get_size, shutdown, linger_s
        self.shutdown_s = shutdown_s
        self._exit = os._exit  # a test replaces it
        # internal state
        self._rank: Optional[int] = None
        self._size: Optional[int] = None
        self._reported_at: Optional[float] = None  # when this rank left its own report
        self._linger_bound = linger_s              # this failure's linger (report's linger_s)
        self._explained_any = False                # this rank explained another's failure
        # set where this process itself shut Horovod down (the stall watchdog): the cause to
        # give for the shut-down this rank then sees, instead of another rank's report
        self.cause_here: Optional[str] = None
        self._done = False                         # this rank's "done" mark is on the board
        self._installed = False

    @classmethod
    def for_horovod(cls, hvd, elastic_wait_s: float = 1.0) -> "FailureReporter":
        """The adapters' reporter on ``hvd`` (horovod.torch or horovod.tensorflow): its rank, size
        and shutdown. In an elastic job (``HOROVOD_ELASTIC=1``) a failed rank does not linger
        (the others recover rather than stop) and a survivor waits ``elastic_wait_s`` for a report."""
        elastic = elastic_mode()
        return cls(hvd.rank, wait_s=elastic_wait_s if elastic else 1.0, get_size=hvd.size,
                   shutdown=hvd.shutdown, linger_s=0.0 if elastic else LINGER_S)

    @property
    def board(self):
        if self._board is None:
            self._board = board_from_env() or False
        return self._board or None

    def rank(self) -> Optional[int]:
        try:
            self._rank = int(self._get_rank())
        except Exception:  # Horovod already shut down: the rank read while it was up
            pass
        return self._rank

    def report(self, exc: BaseException, where: str, linger_s: Optional[float] = None) -> None:
        """Leave ``exc`` on the board (once per exception); never raises. ``linger_s``: this
        failure's linger, if shorter than the reporter's (the stall watchdog's: the ranks it names
        did not arrive, and a rank that does not arrive rarely marks "done"). A rank that has
        already explained another rank's failure does not linger after its own."""
        if getattr(exc, "_hvdp_reported", False) or is_consequence(exc):
            return
        try:
            exc._hvdp_reported = True
        except Exception:
            pass
        FLIGHT.dump(f"{where}: {type(exc).__name__}: {exc}")  # this rank's failure, board or not
        rank, board = self.rank(), self.board
        if board is None or rank is None:
            return
        now = time.time()
        try:
            board.post(rank, make_report(rank, exc, where, now))
        except Exception:  # the report is a courtesy: never hide the real error behind it
            return
        self._reported_at = now
        self._linger_bound = self.linger_s if linger_s is None else min(self.linger_s, linger_s)
        if self._explained_any:  # an error after explaining another rank's failure (a closed pipe to
            self._linger_bound = 0.0  # the launcher): the job has already failed; nobody to wait for
        self.mark_done()  # another failing rank need not wait for this one

    def mark_done(self) -> None:
        """Tell a lingering failed rank that this rank has said what it had to say; never raises."""
        rank, board = self._rank, self.board
        if self._done or board is None or rank is None:
            return
        self._done = True
        try:
            board.mark_done(rank, json.dumps({"rank": rank, "time": time.time()}).encode())
        except Exception:
            pass

    def linger(self) -> float:
        """After this rank reported its own failure: shut Horovod down, then wait (at most
        ``linger_s``, or the shorter one its report asked for) until every other rank is done.
        Returns the seconds waited."""
        if self._reported_at is None or self._linger_bound <= 0 or not self._size or self._size <= 1:
            return 0.0
        board = self.board
        if board is None:
            return 0.0
        self._mark_ending(board)  # a survivor that Horovod's shutdown does not reach stops on it
        if self._shutdown is not None and not self._shut_down_within(self.shutdown_s):
            msg = (f"hvdp: rank {self._rank}: Horovod's shutdown after this rank's error did not finish "
                   f"within {self.shutdown_s:g} s; ending the process (exit 1) so that the launcher stops "
                   f"the other ranks")
            FLIGHT.dump(msg)
            print(msg, file=sys.stderr, flush=True)
            sys.stdout.flush()
            self._exit(1)  # os._exit: Horovod's own exit handler would wait on the same shutdown
            return 0.0
        t0 = time.monotonic()
        waiting = set(range(self._size)) - {self._rank}
        while waiting and time.monotonic() - t0 < self._linger_bound:
            for r in sorted(waiting):
                try:
                    mark = board.read_done(r)
                    fresh = mark is not None and \
                        float(json.loads(mark)["time"]) >= self._reported_at - DONE_SLACK_S
                except Exception:
                    fresh = False
                if fresh:
                    waiting.discard(r)
            if waiting:
                time.sleep(0.05)
        return time.monotonic() - t0

    def _shut_down_within(self, seconds: float, shutdown: Optional[Callable[[], None]] = None) -> bool:
        """Horovod's shutdown (``shutdown``, default this reporter's) in a thread of its own;
        whether it returned (or raised) within ``seconds``."""
        return meet_within(shutdown or self._shutdown, seconds, name="hvdp-shutdown") is not False

    def reports(self) -> List[dict]:
        board, rank = self.board, self.rank()
        if board is None:
            return []
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                found = parse_reports(board.read(), exclude_rank=rank)
            except Exception:
                found = []
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def explained(self, exc: BaseException, where: str = "in hvdp's gradient reduction") -> BaseException:
        """``exc`` itself for a cause (after reporting it); for Horovod's shut-down, an exception
        of the same type whose message names the failed rank (elastic code catches by type)."""
        if not is_consequence(exc):
            self.report(exc, where)
            return exc
        if getattr(exc, "_hvdp_explained", False):
            return exc
        msg = self.explanation(str(exc))
        FLIGHT.dump(f"Horovod shut down under this rank: {msg}")
        self._explained_any = True
        try:
            new = type(exc)(msg)
        except Exception:
            new = RuntimeError(msg)
        new._hvdp_explained = True
        return new

    def explanation(self, original: str) -> str:
        """What to say of Horovod's shut-down (``original``: what Horovod said)."""
        if self.cause_here is not None:
            return f"{self.cause_here}\nso rank {self.rank()} shut Horovod down, and saw: {original}"
        return explain(original, self.reports(), self.rank())

    @contextmanager
    def explaining(self, where: str = "in hvdp's gradient reduction") -> Iterator[None]:
        """Report an error raised inside; re-raise Horovod's shut-down with its cause named."""
        try:
            yield
        except Exception as e:
            new = self.explained(e, where)
            if new is e:
                raise
            raise new from e

    def install(self) -> None:
        """Report uncaught errors; explain an uncaught Horovod shut-down. Idempotent."""
        if self._installed:
            return
        self._installed = True
        self.rank()
        if self._get_size is not None:
            try:
                self._size = int(self._get_size())
            except Exception:
                pass
            FLIGHT.attach(self._get_rank, self._get_size)  # the flight record's file is per rank
        FLIGHT.install_signals()  # a dump on SIGUSR1 / SIGTERM (then the handler there before)
        previous = sys.excepthook

        def hook(tp, value, tb):
            if value is not None and is_consequence(value) and not getattr(value, "_hvdp_explained", False):
                msg = self.explanation(str(value).splitlines()[0][:300])
                FLIGHT.dump(f"Horovod shut down under this rank: {msg}")
                print(msg, file=sys.stderr, flush=True)
            elif value is not None:
                self.report(value, "uncaught in the training script")
            previous(tp, value, tb)
            sys.stderr.flush()
            if value is not None and is_consequence(value):
                self.mark_done()  # printed: a lingering failed rank may go
            self.linger()

        sys.excepthook = hook
        # a survivor that caught the explained error and exits on its own is done too; atexit runs
        # this before Horovod's own shutdown (registered earlier, by hvd.init)
        atexit.register(lambda: self.mark_done() if self._explained_any else None)
