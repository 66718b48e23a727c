"""What the core needs from a communication layer: a few async collectives, passed in by an adapter.

The core never imports Horovod's framework modules; the torch adapter passes functions built on
``horovod.torch`` and the Keras adapter functions built on ``horovod.tensorflow``.
"""
from __future__ import annotations

from typing import Any, Protocol

Array = Any
Handle = Any

AVERAGE = "average"
SUM = "sum"


class ProcessSetCollectives:
    """Base of the adapters' collectives: size and rank from a Horovod process set, read live
    (an elastic reset changes them)."""

    def __init__(self, process_set):
        self.process_set = process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    def done(self, handle) -> bool:
        """Whether :meth:`wait` on ``handle`` would return at once (default: not known, False: a
        reducer then starts its next phase only when waited for)."""
        return False


class Collectives(Protocol):
    size: int
    rank: int

    def allreduce_async(self, x: Array, name: str, op: str, prescale: float, postscale: float) -> Handle:
        """Sum (or average) ``x`` over the workers, scaled by prescale before and postscale after."""

    def alltoall_async(self, buf: Array, name: str) -> Handle:
        """Equal splits: the r-th of ``size`` equal slices of ``buf`` goes to rank r."""

    def allgather_async(self, buf: Array, name: str) -> Handle:
        """Concatenation of every rank's ``buf`` (equal sizes), in rank order."""

    def wait(self, handle: Handle) -> Array:
        """Block until a handle is done and return its output."""

    def done(self, handle: Handle) -> bool:
        """Whether :meth:`wait` would return at once; never blocks (False where it cannot tell)."""


def allreduce_recorded(comm: Collectives, x: Array, name: str, op: str, postscale: float, stats,
                       label: str, elements: int, nbytes: int) -> Handle:
    """A flat buffer's allreduce (the reducers' whole-bucket path), its bytes recorded in
    ``stats`` (a ``WireStats`` or None); on one worker the buffer itself, scaled."""
    if stats is not None:
        stats.record_allreduce(label, elements, nbytes, comm.size)
    if comm.size > 1:
        return comm.allreduce_async(x, name, op, 1.0, postscale)
    return x if postscale == 1.0 else x * postscale
