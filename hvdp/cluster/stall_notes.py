"""The stall watchdog's notes on the failure board, and its message from them.

A wait half the deadline old leaves "rank r waits at <collective> since <time>" on the board
(``StallNotes._put_note``); at the deadline the watchdog reads every rank's note
(``StallNotes.notes``) and ``describe`` names the ranks that left none (they did not arrive)
and those waiting elsewhere. A mixin of :class:`hvdp.cluster.watchdog.StallWatchdog`, which
holds the reporter (its board) and the rank.
"""
from __future__ import annotations

import json
import socket
import time
from typing import Dict, Optional

NOTE_KEY = "stall-{rank}"


def describe(rank: int, name: str, timeout_s: float, size: int, notes: Dict[int, dict],
             board: bool) -> str:
    """The watchdog's message from every rank's note (rank -> its note), this rank's included."""
    head = (f"hvdp stall watchdog: rank {rank} waited {timeout_s:g} s at {name}")
    if not board:
        return (f"{head}; no failure board, so which ranks did not arrive is unknown (they did not "
                "submit their part of it: a long evaluation or data loading on one rank, an exited "
                f"or killed rank, or ranks that call collectives in another order). {_FIX}")
    missing = [r for r in range(size) if r not in notes]
    elsewhere = sorted((r, n["name"]) for r, n in notes.items() if n.get("name") != name)
    parts = []
    if missing:
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                     f"did not arrive")
    parts += [f"rank {r} waits at {n} instead" for r, n in elsewhere]
    if not parts:
        parts.append("every rank waits there (Horovod itself made no progress)")
    return f"{head}: {'; '.join(parts)}. {_FIX}"


_FIX = ("Find what that rank is doing (its own log, py-spy dump); for work that legitimately "
        "takes longer on some ranks raise HVDP_STALL_TIMEOUT_SECONDS (0: no watchdog).")


class StallNotes:
    """The board side of :class:`hvdp.cluster.watchdog.StallWatchdog` (its ``_reporter`` and
    ``_get_rank``)."""

    def _board(self):
        return self._reporter.board if self._reporter is not None else None

    def _put_note(self, w: Optional[object]) -> None:
        board = self._board()
        if board is None:
            return
        try:
            rank = int(self._get_rank())
            data = {"rank": rank, "host": socket.gethostname(), "time": time.time()}
            if w is not None:
                data.update(name=w.name, since=w.wall0)
            board.put(NOTE_KEY.format(rank=rank), json.dumps(data).encode())
        except Exception:
            pass

    def notes(self, size: int, since: float) -> Dict[int, dict]:
        """Every rank's current note of a wait that began after ``since`` - one deadline
        (older ones are of earlier waits that the ranks left without clearing)."""
        board, out = self._board(), {}
        if board is None:
            return out
        for r in range(size):
            try:
                got = board.get(NOTE_KEY.format(rank=r))
                n = json.loads(got) if got else None
            except Exception:
                n = None
            if n and n.get("name") is not None and float(n.get("since", 0)) >= since:
                out[r] = n
        return out
