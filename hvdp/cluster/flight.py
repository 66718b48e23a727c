"""A flight record: each rank's last collectives, kept in a ring and dumped when the job goes wrong.

When a job stalls or dies, the question is which collective the ranks parted at: one rank waits
in an allreduce that another never reached, or reached and never finished. Each process keeps
its last ``HVDP_FLIGHT_RECORDS`` (default 1024; 0: off) of hvdp's collectives in a ring: name,
its number among the collectives of that name (the n-th ``hvdp.opt0.a2a.b0`` of this rank meets
the n-th of every other rank), codec, phase, bytes, the engine's step, start and end time, and
whether it finished, its wait failed, its submit was refused (Horovod already down) or it is
still in flight. Counters per name survive the ring, so a
record pushed out of it is still known to have started (and finished).

The record is written as JSON, one file per rank (``rank-<r>.json``, replaced atomically), into
``HVDP_FLIGHT_DIR`` (default ``hvdp-flight`` in the working directory) when:

- the stall watchdog fires (``hvdp.cluster.watchdog``);
- hvdp's failure path sees an error: this rank's own (``FailureReporter.report``) or Horovod shut
  down under it (``FailureReporter.explained`` and the exception hook);
- the process gets SIGUSR1 (a dump on request, the process goes on) or SIGTERM (what horovodrun
  sends the survivors when one rank exits; the previous handler then runs as before).

``python -m hvdp trace DIR`` merges the files (``hvdp.cluster.trace``).

Recording costs two ``time.time()`` calls, a dict update and a list append per collective (see
``benchmarks/flight_cost.py``); a dump happens only on the events above.

Example::

    rec = RECORDER.start("hvdp.opt0.a2a.b0", "int8", "alltoall", 4096, step=3)
    ...                                   # the collective runs
    RECORDER.end(rec)                     # or RECORDER.end(rec, FAILED) if its wait raised
    RECORDER.dump("SIGUSR1")              # -> path of hvdp-flight/rank-<r>.json
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..config import flight_dir, flight_records
from .flight_signals import SignalDumps

VERSION = 1
# one record: a list, so that its end is written in place
SEQ, NAME, NTH, CODEC, PHASE, NBYTES, STEP, T0, T1, STATE = range(10)
FIELDS = ("seq", "name", "nth", "codec", "phase", "bytes", "step", "start", "end", "state")
# in flight; finished; its wait raised; its submit raised (Horovod already down, or refused it)
STARTED, DONE, FAILED, REFUSED = "started", "done", "failed", "refused"


def job_id(environ=None) -> str:
    """What tells this job's dumps from another's in the same directory: horovodrun's Gloo
    rendezvous, the MPI or Slurm job; "" when none is known."""
    env = os.environ if environ is None else environ
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return f"gloo:{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
    for key in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if env.get(key):
            return f"{key}:{env[key]}"
    return ""


class FlightRecorder(SignalDumps):
    """One per process (:data:`RECORDER`); the adapters' collectives pass through
    ``hvdp.reduce.recorded.Recorded``, which calls :meth:`start` and :meth:`end`.

    Args:
        capacity: records kept; None: ``HVDP_FLIGHT_RECORDS`` at the first record; 0: off.
        directory: where dumps go; None: ``HVDP_FLIGHT_DIR`` (read at each dump).
        clock: wall-clock seconds (comparable between hosts, roughly).
    """

    def __init__(self, capacity: Optional[int] = None, directory: Optional[str] = None,
                 clock: Callable[[], float] = time.time):
        # settings
        self._capacity, self._directory, self._clock = capacity, directory, clock
        # internal state
        self._ring: Optional[deque] = None        # made at the first record (capacity read then)
        self._seq = 0                              # collectives started by this process
        self.started: Dict[str, int] = {}          # name -> how many started (the ring forgets)
        self.finished: Dict[str, int] = {}         # name -> how many finished
        self._get_rank: Optional[Callable[[], int]] = None
        self._get_size: Optional[Callable[[], int]] = None
        self._rank: Optional[int] = None
        self._size: Optional[int] = None
        self.reasons: List[dict] = []              # why it was dumped, in order
        self.resets = 0                            # elastic resets this process went through
        # name -> read() -> (begun, ended): collectives no Python call brackets (count_outside),
        # and their counts when this world began
        self._outside: Dict[str, Callable[[], Tuple[int, int]]] = {}
        self._outside_base: Dict[str, Tuple[int, int]] = {}
        # dumps only (the watchdog, signals, the main thread); re-entrant: a signal handler may
        # run on the main thread in the middle of its own dump
        self._lock = threading.RLock()
        self._init_signals()

    @property
    def capacity(self) -> int:
        if self._capacity is None:
            self._capacity = flight_records()      # HVDP_FLIGHT_RECORDS; bad value: ValueError
        return self._capacity

    # --- recording (the hot path: keep it to a few attribute reads) -------------------------------
    def start(self, name: str, codec: str, phase: str, nbytes: int, step: int = -1) -> Optional[list]:
        """A collective was submitted; -> its record (for :meth:`end`), None when recording is off."""
        ring = self._ring
        if ring is None:
            if self.capacity <= 0:
                return None
            ring = self._ring = deque(maxlen=self.capacity)
        nth = self.started.get(name, 0)
        self.started[name] = nth + 1
        self._seq += 1
        rec = [self._seq, name, nth, codec, phase, nbytes, step, self._clock(), None, STARTED]
        ring.append(rec)
        return rec

    def end(self, rec: Optional[list], state: str = DONE) -> None:
        """The collective of ``rec`` finished (``DONE``), its wait raised (``FAILED``) or its
        submit raised (``REFUSED``: the rank got there, the collective never started)."""
        if rec is None or rec[STATE] != STARTED:
            return
        rec[T1] = self._clock()
        rec[STATE] = state
        if state == DONE:
            self.finished[rec[NAME]] = self.finished.get(rec[NAME], 0) + 1

    def submitted(self, submit: Callable[[], Any], name: str, codec: str, phase: str, nbytes: int,
                  step: int = -1) -> Tuple[Any, Optional[list]]:
        """``submit()``, a collective's asynchronous submit, recorded: -> (what it returned, its
        record for :meth:`end`); one that raised (Horovod already shut down) is recorded as
        ``REFUSED`` and raises on."""
        try:
            out = submit()
        except BaseException:
            self.end(self.start(name, codec, phase, nbytes, step), REFUSED)
            raise
        return out, self.start(name, codec, phase, nbytes, step)

    def waited(self, rec: Optional[list], wait: Callable[[], Any]) -> Any:
        """``wait()``, the wait of the collective of ``rec``: -> what it returned; ``rec`` ends
        done, or failed where the wait raised."""
        try:
            out = wait()
        except BaseException:
            self.end(rec, FAILED)
            raise
        self.end(rec)
        return out

    @contextmanager
    def around(self, name: str, phase: str, nbytes: int = -1) -> Iterator[None]:
        """One blocking call recorded as a collective: Horovod's module collectives as user code
        calls them through hvdp (``hvdp.cluster.watchdog``), an elastic state's broadcasts."""
        rec = self.start(name, "none", phase, nbytes)
        try:
            yield
        except BaseException:
            self.end(rec, FAILED)
            raise
        self.end(rec)

    def count_outside(self, name: str, read: Callable[[], Tuple[int, int]]) -> None:
        """Collectives that run where no Python call brackets them: a traced Keras step's, inside
        TensorFlow's executor, which count the reductions they begin and end (``read() ->
        (begun, ended)``, counted from 0 when registered). A dump adds them to the counts under
        ``name`` and, where one is in flight, a record of it (started; its start time unknown:
        the dump's)."""
        self._outside[name] = read
        self._outside_base[name] = (0, 0)

    def _outside_now(self) -> Dict[str, Tuple[int, int]]:
        out = {}
        for name, read in self._outside.items():
            try:
                begun, ended = read()
            except Exception:  # the counters' framework is gone: nothing to add
                continue
            b0, e0 = self._outside_base.get(name, (0, 0))
            out[name] = (int(begun) - b0, int(ended) - e0)
        return out

    def new_world(self) -> None:
        """After an elastic reset, on every rank at the same point (``hvd.elastic.run``'s next
        attempt): the n-th collective of a name is counted from here, so that a worker that joined
        now and one that was there from the start number the collectives they will meet alike.
        The ring is emptied (its records belong to the world before); the dump counts resets."""
        self.resets += 1
        self.started, self.finished = {}, {}
        for name, (b, e) in self._outside_now().items():
            b0, e0 = self._outside_base.get(name, (0, 0))
            self._outside_base[name] = (b + b0, e + e0)
        if self._ring is not None:
            self._ring.clear()

    # --- identity -------------------------------------------------------------------------------
    def attach(self, get_rank: Callable[[], int], get_size: Callable[[], int]) -> None:
        """Where this process's rank and the job's size come from (read while Horovod is up)."""
        self._get_rank, self._get_size = get_rank, get_size
        self._identity()

    def _identity(self):
        for attr, get in (("_rank", self._get_rank), ("_size", self._get_size)):
            if get is not None:
                try:
                    setattr(self, attr, int(get()))
                except Exception:  # Horovod already down: the value read while it was up
                    pass
        return self._rank, self._size

    # --- the dump -------------------------------------------------------------------------------
    def snapshot(self, reason: Optional[str] = None) -> dict:
        """What a dump writes (``reason`` added to the reasons first)."""
        rank, size = self._identity()
        if reason is not None:
            self.reasons.append({"time": self._clock(), "reason": reason[:2000]})
        records = [list(r) for r in tuple(self._ring or ())]  # one C-level copy: safe against an append
        started, finished, now = dict(self.started), dict(self.finished), self._clock()
        for name, (begun, ended) in self._outside_now().items():
            started[name], finished[name] = begun, ended
            if begun > ended:  # in flight (the n-th of them, n = those ended)
                records.append([0, name, ended, "", "inside TensorFlow's executor", -1, -1, now, None, STARTED])
        return {"version": VERSION, "rank": rank, "size": size, "host": socket.gethostname(),
                "pid": os.getpid(), "job": job_id(), "time": self._clock(),
                "capacity": self.capacity, "resets": self.resets, "reasons": list(self.reasons),
                "fields": list(FIELDS),
                "started": started, "finished": finished, "records": records}

    def path(self, directory: Optional[str] = None) -> str:
        d = directory or self._directory or flight_dir()
        rank = self._rank if self._rank is not None else f"pid{os.getpid()}"
        return os.path.join(d, f"rank-{rank}.json")

    def dump(self, reason: str, directory: Optional[str] = None) -> Optional[str]:
        """Write the record (replacing this rank's earlier dump); -> the file, None when off or
        the write failed (a dump must never hide the error it is made for)."""
        try:
            if self.capacity <= 0 or (self._seq == 0 and self._get_rank is None):
                return None  # nothing to say (e.g. a forked data-loader worker)
            with self._lock:
                data = self.snapshot(reason)
                path = self.path(directory)
                os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(data, f, separators=(",", ":"))
                os.replace(tmp, path)
                return path
        except Exception as e:
            try:
                print(f"hvdp: flight record not written ({type(e).__name__}: {e})", file=sys.stderr)
            except Exception:
                pass
            return None

    # --- after a signal or a fork (the handlers: hvdp.cluster.flight_signals) ----------------------
    def ended_message(self, signame: str, path: Optional[str]) -> str:
        """What a rank ended by ``signame`` says (horovodrun's SIGTERM to every rank once one has
        exited, e.g. a rank SIGKILLed: the survivors' own errors may not have been printed yet)."""
        open_rec = next((r for r in reversed(tuple(self._ring or ())) if r[STATE] != DONE), None)
        where = (f"in {open_rec[NAME]} #{open_rec[NTH]} ({open_rec[PHASE]}, {open_rec[STATE]})" if open_rec
                 else "outside hvdp's collectives")
        return (f"hvdp: rank {self._rank} ended by {signame} {where}. A launcher such as horovodrun stops "
                "every rank once one has exited: the rank it names as the first to exit is the one that "
                "failed (one killed by SIGKILL or the OOM killer leaves no report of its own). Flight "
                f"record: {path or 'not written'}; merge the ranks' records with: python -m hvdp trace DIR")

    def _after_fork(self) -> None:
        """In a forked child (a data loader's worker): its signals must not reach the parent's
        watcher (``_detach_signals``), and its record starts empty (it would otherwise dump the
        parent's as its own)."""
        self._detach_signals()
        self._lock = threading.RLock()
        self._ring, self._seq, self.started, self.finished, self.reasons = None, 0, {}, {}, []
        self._get_rank = self._get_size = self._rank = self._size = None


RECORDER = FlightRecorder()

