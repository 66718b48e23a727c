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
