"""In-process collectives for P simulated workers: the reference that unit tests and benchmarks
run the core against, with no processes.

Each worker gets a ``FakeComm``; an operation is complete once every worker has posted its part,
so a test drives all workers phase by phase (all start, all exchange, all finish).
"""
import threading

import numpy as np

from hvdp.reduce.collectives import AVERAGE


class FakeGroup:
    """``blocking``: a wait blocks until every worker has posted (each worker then runs in its
    own thread; needed where one call holds several dependent collectives)."""

    def __init__(self, size, blocking=False):
        self.size = size
        self.board = {}
        self.blocking = blocking
        self.posted = threading.Condition()
        self.comms = [FakeComm(self, r) for r in range(size)]


class FakeComm:
    def __init__(self, group, rank):
        self.group, self.rank = group, rank
        self._seq = {}

    @property
    def size(self):
        return self.group.size

    def _post(self, kind, name, buf):
        if self.group.blocking:  # a worker's n-th (kind, name) meets the others' n-th
            n = self._seq[(kind, name)] = self._seq.get((kind, name), -1) + 1
            name = (name, n)
        with self.group.posted:
            self.group.board.setdefault((kind, name), {})[self.rank] = np.array(buf, copy=True)
            self.group.posted.notify_all()
        return (kind, name, self.rank)

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return self._post("allreduce", name, np.asarray(x) * prescale) + ((op, postscale),)

    def alltoall_async(self, buf, name):
        return self._post("alltoall", name, buf)

    def allgather_async(self, buf, name):
        return self._post("allgather", name, buf)

    def done(self, handle):
        kind, name = handle[:2]
        with self.group.posted:
            return len(self.group.board.get((kind, name), ())) == self.size

    def wait(self, handle):
        kind, name, rank = handle[:3]
        if self.group.blocking:
            with self.group.posted:
                if not self.group.posted.wait_for(lambda: len(self.group.board[(kind, name)]) == self.size, 30):
                    raise RuntimeError(f"{kind} {name}: not every worker posted within 30 s")
        parts = self.group.board[(kind, name)]
        if len(parts) != self.size:
            raise RuntimeError(f"{kind} {name}: only {len(parts)} of {self.size} workers posted; "
                               "drive every worker through a phase before waiting on it")
        if kind == "allgather":
            return np.concatenate([parts[r] for r in range(self.size)])
        if kind == "alltoall":
            return np.concatenate([np.split(parts[r], self.size)[rank] for r in range(self.size)])
        op, post = handle[3]
        total = sum(parts[r] for r in range(self.size)) * post
        return total / self.size if op == AVERAGE else total
