"""``python -m hvdp trace DIR``: merge the ranks' flight records and name where they parted.

Each rank's dump (``hvdp.cluster.flight``) says, per collective name, how many it started and
finished, and holds its last records. A collective is the pair (name, n): the n-th collective of
that name on each rank. The report names where the ranks parted: the first collective (ordered by
when the earliest rank started it) that some rank started and another never reached (or reached
only once Horovod was down); where there is none, the first that some rank never finished. It
says which ranks did what; a rank without a dump (killed by SIGKILL or the OOM killer, which
leave none) is named as such. Exit status: 0 when every rank finished every collective
recorded, 1 when a divergence was found, 2 when there is nothing to read.

Example::

    $ python -m hvdp trace hvdp-flight
    first divergence: hvdp.opt0.fc.weight #1 (none, allreduce (as given), 1024 bytes, step 1)
      started, never finished: rank 0 (at 10:14:03.201, waited 4.0 s)
      never reached: rank 1 (last: hvdp.opt0.fc.bias #0, done at 10:13:59.188)
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .flight import DONE, FAILED, FIELDS, REFUSED, STARTED

Key = Tuple[str, int]


def load(directory: str) -> Tuple[Dict[int, dict], List[str]]:
    """The newest job's dumps in ``directory``: ({rank: dump}, notes on what was left out)."""
    dumps, notes = [], []
    for path in sorted(glob.glob(os.path.join(directory, "rank-*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
            d["records"] = [dict(zip(d.get("fields", FIELDS), r)) for r in d["records"]]
            dumps.append(d)
        except Exception as e:
            notes.append(f"{os.path.basename(path)} unreadable ({type(e).__name__}: {e})")
    if not dumps:
        return {}, notes
    job = max(dumps, key=lambda d: d.get("time", 0)).get("job", "")
    other = [d for d in dumps if d.get("job", "") != job]
    if other:
        notes.append(f"{len(other)} dump(s) of another job left out (job {job or 'unknown'} is the newest)")
    return {d["rank"] if d.get("rank") is not None else -1 - i: d
            for i, d in enumerate(dumps) if d.get("job", "") == job}, notes


class Status(NamedTuple):
    state: str               # "done", "failed", "started" (in flight), "unreached", "unknown" (no dump)
    record: Optional[dict]   # its record, when still in the ring


def status(dump: Optional[dict], key: Key) -> Status:
    if dump is None:
        return Status("unknown", None)
    name, nth = key
    rec = next((r for r in dump["records"] if r["name"] == name and r["nth"] == nth), None)
    if rec is not None:
        return Status(rec["state"], rec)
    if dump["started"].get(name, 0) <= nth:
        return Status("unreached", None)
    return Status(DONE if dump["finished"].get(name, 0) > nth else STARTED, None)


class Divergence(NamedTuple):
    key: Key
    record: dict                   # the earliest rank's record of it
    by_state: Dict[str, List[int]]  # state -> ranks


REACHED = {DONE, FAILED, STARTED}     # the collective started on that rank
NOT_STARTED = {"unreached", REFUSED}  # the rank never got there, or only once Horovod was down


def analyse(dumps: Dict[int, dict], size: Optional[int] = None) -> Optional[Divergence]:
    """Where the ranks parted: the first collective (by its earliest start) that some rank
    started and another never reached (or reached only once it was refused); else the first that
    some rank never finished; None when every rank with a dump finished every one recorded. A
    rank without a dump alone makes no divergence (it is named with the one found)."""
    if size is None:
        size = max([d.get("size") or 0 for d in dumps.values()] + [max(dumps, default=-1) + 1])
    ranks = sorted(set(range(size)) | {r for r in dumps if r >= 0})
    first: Dict[Key, dict] = {}
    for d in dumps.values():
        for r in d["records"]:
            k = (r["name"], r["nth"])
            if k not in first or r["start"] < first[k]["start"]:
                first[k] = r
    unfinished = None
    for key in sorted(first, key=lambda k: (first[k]["start"], first[k]["seq"])):
        by_state: Dict[str, List[int]] = {}
        for rank in ranks:
            by_state.setdefault(status(dumps.get(rank), key).state, []).append(rank)
        if set(by_state) & REACHED and set(by_state) & NOT_STARTED:
            return Divergence(key, first[key], by_state)
        if unfinished is None and set(by_state) - {"unknown", DONE}:
            unfinished = Divergence(key, first[key], by_state)
    return unfinished


def _clock(t: Optional[float]) -> str:
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"


def _last(dump: dict) -> str:
    if not dump["records"]:
        return "no collective recorded"
    r = max(dump["records"], key=lambda r: r["seq"])
    return f"last: {r['name']} #{r['nth']}, {r['state']} at {_clock(r['end'] or r['start'])}"


WORDS = {"done": "started and finished", "failed": "started, its wait failed",
         "started": "started, never finished", "unreached": "never reached",
         "refused": "reached it only once Horovod was down (its submit failed)",
         "unknown": "no dump (killed, e.g. SIGKILL or the OOM killer, or it never reached a dump point)"}


def report(dumps: Dict[int, dict], notes: Sequence[str] = ()) -> Tuple[str, int]:
    """The text ``python -m hvdp trace`` prints, and its exit status."""
    if not dumps:
        return "\n".join(list(notes) + ["no flight records (rank-*.json) found"]), 2
    lines = []
    for rank, d in sorted(dumps.items()):
        why = d["reasons"][0]["reason"].splitlines()[0][:160] if d.get("reasons") else "?"
        lines.append(f"rank {rank} ({d.get('host', '?')}, pid {d.get('pid', '?')}): "
                     f"{len(d['records'])} records, dumped: {why}")
    lines += [f"note: {n}" for n in notes]
    div = analyse(dumps)
    if div is None:
        missing = sorted(set(range(max(d.get("size") or 0 for d in dumps.values()))) - set(dumps))
        lines.append("no divergence: every rank with a dump finished every collective recorded"
                     + (f"; {WORDS['unknown']}: rank {', '.join(map(str, missing))}" if missing else ""))
        return "\n".join(lines), 0
    (name, nth), r = div.key, div.record
    lines.append(f"first divergence: {name} #{nth} ({r['codec']}, {r['phase']}, {r['bytes']} bytes, "
                 f"step {r['step']})")
    now = max(d.get("time", 0) for d in dumps.values())
    for state in ("done", "failed", "started", "refused", "unreached", "unknown"):
        ranks = div.by_state.get(state)
        if not ranks:
            continue
        what = []
        for rank in ranks:
            s = status(dumps.get(rank), div.key)
            if state in ("started", "failed") and s.record is not None:
                end = s.record["end"] or dumps[rank].get("time", now)
                what.append(f"rank {rank} (at {_clock(s.record['start'])}, waited "
                            f"{end - s.record['start']:.1f} s)")
            elif state == "refused" and s.record is not None:
                what.append(f"rank {rank} (at {_clock(s.record['start'])})")
            elif state == "unreached":
                what.append(f"rank {rank} ({_last(dumps[rank])})")
            else:
                what.append(f"rank {rank}")
        lines.append(f"  {WORDS[state]}: {', '.join(what)}")
    return "\n".join(lines), 1


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m hvdp trace DIR   (DIR: where the ranks dumped their flight "
              "records, HVDP_FLIGHT_DIR, default ./hvdp-flight)", file=sys.stderr)
        return 2
    text, rc = report(*load(argv[0]))
    print(text)
    return rc
