"""A failing rank's report on a board and a survivor's explanation from it (the format of
``hvdp.cluster.failures``, pure functions: no board, no Horovod).

Example::

    blob = make_report(1, ValueError("bad batch"), "step 3")
    explain("Horovod has been shut down", parse_reports([blob], exclude_rank=0), rank=0)
"""
from __future__ import annotations

import json
import re
import socket
import time
import traceback
from typing import List, Optional

SHUTDOWN_TEXT = "Horovod has been shut down"
MAX_TEXT = 600          # characters of the failing exception kept in a report
MAX_AGE_S = 300         # an older report is from an earlier, recovered failure (elastic)


def is_consequence(exc: BaseException) -> bool:
    """An error that only says another rank went away (Horovod's shut-down), not a cause."""
    return type(exc).__name__ == "HorovodInternalError" or SHUTDOWN_TEXT in str(exc)


# What a failed Horovod op's TF error says: Horovod's own text, a Gloo transport error (the file path
# of gloo's sources: "gloo/transport/tcp/pair.cc:589] Read error ...: Connection reset by peer"), or
# the failing node's name, which for hvdp's collectives starts with "hvdp." and for Horovod's
# unnamed ones with the op type ("HorovodAllreduce_...").
_COLLECTIVE_FAILURE = re.compile(r"Horovod|\bgloo/|\{\{node (?:[^}]*/)?hvdp\.")


def collective_failed(message: str) -> bool:
    """Whether an error message is that of a failed Horovod collective (an elastic reset), not of
    the user's own computation."""
    return bool(_COLLECTIVE_FAILURE.search(message or ""))


def make_report(rank: int, exc: BaseException, where: str, now: Optional[float] = None) -> bytes:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + " ..."
    return json.dumps({"rank": rank, "host": socket.gethostname(), "error": text, "where": where,
                       "time": time.time() if now is None else now}).encode()


def parse_reports(blobs: List[bytes], exclude_rank: int, now: Optional[float] = None) -> List[dict]:
    """Fresh reports of other ranks, earliest first; unreadable ones are skipped."""
    now = time.time() if now is None else now
    out = []
    for b in blobs:
        try:
            r = json.loads(b)
            if r["rank"] != exclude_rank and now - float(r["time"]) <= MAX_AGE_S:
                out.append(r)
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: r["time"])


def explain(original: str, reports: List[dict], rank: Optional[int]) -> str:
    """The survivor's message: the cause first, then what this rank saw."""
    me = f"rank {rank}" if rank is not None else "this rank"
    if reports:
        first = reports[0]
        lines = [f"hvdp: rank {first['rank']} (host {first['host']}) failed first, {first['where']}:",
                 f"    {first['error']}"]
        lines += [f"  then rank {r['rank']} (host {r['host']}): {r['error'].splitlines()[-1]}"
                  for r in reports[1:3]]
        lines.append(f"so Horovod shut down, and {me} saw: {original}")
    else:
        lines = [f"hvdp: {me} saw Horovod shut down, and no other rank reported an error: one exited "
                 "without raising (e.g. it finished its loop early or never called step()), was "
                 "killed (OOM killer, SIGKILL), runs on another host without a shared board (MPI), or "
                 "Horovod's stall inspector stopped the job (its message is in rank 0's log). "
                 f"Horovod said: {original}"]
    return "\n".join(lines)
