"""hvdp's collectives protocol (``hvdp.reduce.collectives``) on horovod.torch's async ops."""
import itertools
from collections import defaultdict
from typing import Dict, Iterator

import horovod.torch as _hvd

from hvdp.reduce.collectives import AVERAGE, ProcessSetCollectives

from .agreement import WATCHDOG

# Horovod refuses a second tensor under a name still in flight, so each optimizer's collectives
# carry its number in creation order per process set: the same on every rank of the set (every
# rank makes its optimizers in the same order; the ranks-agree check compares the number).
_COUNTERS: Dict[int, Iterator[int]] = defaultdict(itertools.count)


def next_instance(process_set=_hvd.global_process_set) -> int:
    """The next optimizer number on ``process_set`` (0, 1, ... in creation order)."""
    return next(_COUNTERS[getattr(process_set, "process_set_id", None) or 0])


def synchronize(handle, name: str):
    """Horovod's ``synchronize`` under the stall watchdog (``name``: what the message calls it);
    a callable handle (Horovod's sparse allreduce hands one back) is called instead."""
    with WATCHDOG.waiting(name):
        return handle() if callable(handle) else _hvd.synchronize(handle)


class TorchCollectives(ProcessSetCollectives):
    """``scope`` prefixes every collective name, so two reducers can be in flight together."""

    def __init__(self, process_set=_hvd.global_process_set, scope: str = ""):
        super().__init__(process_set)
        self.scope = scope
        self._names = {}  # handle -> collective name, for the stall watchdog's message

    def _named(self, handle, name):
        self._names[handle] = self.scope + name
        return handle

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        h = _hvd.allreduce_async_(x, name=self.scope + name,
                                  op=_hvd.Average if op == AVERAGE else _hvd.Sum,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self.process_set)
        return self._named(h, name)

    def alltoall_async(self, buf, name):
        h = _hvd.alltoall_async(buf, name=self.scope + name, process_set=self.process_set)
        return self._named(h, name)

    def allgather_async(self, buf, name):
        h = _hvd.allgather_async(buf, name=self.scope + name, process_set=self.process_set)
        return self._named(h, name)

    def done(self, handle) -> bool:
        """Horovod's ``poll``: the collective has finished (a callable handle: not known)."""
        return not callable(handle) and bool(_hvd.poll(handle))

    def wait(self, handle):
        out = synchronize(handle, self._names.pop(handle, self.scope + "(collective)"))
        return out[0] if isinstance(out, tuple) else out  # alltoall also returns received splits
