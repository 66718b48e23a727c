"""A failed rank's "ending" mark on the failure board (``hvdp.cluster.failures``), and what a
survivor does on it.

A rank that failed with an uncaught error shuts Horovod down, which normally fails every other
rank's collective at once. Rarely (seen under MPI and Gloo) that shutdown never reaches the
others, and they would wait until the launcher killed them without a word. So the failing rank
first leaves a mark, and a survivor's stall watchdog (``hvdp.cluster.watchdog``), once a wait has
lasted a second, looks for it and shuts Horovod down itself.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Callable, Optional

from .flight import RECORDER as FLIGHT

ENDING_KEY = "ending"   # the board's key of the latest "this rank is ending after its error" mark
ENDING_SHUTDOWN_S = 10.0  # a survivor's own shutdown, once told that a rank is ending, not back by then: exit


class EndingMarks:
    """Mixed into ``FailureReporter``, which provides ``board``, ``rank()``, ``explanation()``,
    ``mark_done()``, ``_shut_down_within()``, ``_rank`` and ``_exit``."""

    def _mark_ending(self, board) -> None:
        try:
            board.put(ENDING_KEY, json.dumps({"rank": self._rank, "time": time.time()}).encode())
        except Exception:
            pass

    def ending_rank(self, since: float) -> Optional[int]:
        """Another rank that said on the board, at or after ``since`` (wall clock), that it is
        ending after its uncaught error (:meth:`linger`); None if none did. Never raises."""
        board = self.board
        if board is None:
            return None
        try:
            got = board.get(ENDING_KEY)
            mark = json.loads(got) if got else None
            if mark and float(mark["time"]) >= since and int(mark["rank"]) != self.rank():
                return int(mark["rank"])
        except Exception:
            pass
        return None

    def stop_waiting(self, rank: int, name: str, shutdown: Optional[Callable[[], None]] = None) -> None:
        """This rank waits at ``name`` for rank ``rank``, which has said it is ending after its
        error (the stall watchdog's thread calls this): Horovod's shutdown normally reaches every
        rank then, but where it did not (seen rarely under MPI and Gloo) this rank would wait
        forever. Shut Horovod down here (``shutdown``, default this reporter's), so that the wait
        fails and is explained as usual; where that shutdown does not return within
        ``ENDING_SHUTDOWN_S``, say why and end the process (exit 1), so that the launcher stops
        the job."""
        FLIGHT.dump(f"rank {rank} is ending after its error (failure board) while rank {self.rank()} "
                    f"waits at {name}")
        if (shutdown or self._shutdown) is None or self._shut_down_within(ENDING_SHUTDOWN_S, shutdown):
            return
        seen = f"Horovod did not shut down within {ENDING_SHUTDOWN_S:g} s while this rank waited at {name}"
        msg = (f"{self.explanation(seen)}\nhvdp: rank {self._rank}: ending the process (exit 1) so that the "
               "launcher stops the job")
        FLIGHT.dump(msg)
        print(msg, file=sys.stderr, flush=True)
        self.mark_done()
        sys.stdout.flush()
        self._exit(1)
