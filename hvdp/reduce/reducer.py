"""The contracts of the reduction: what the engine may ask of a reducer (:class:`Reducer`), and
the two framework pieces an adapter hands the engine besides array ops and collectives
(:class:`Store`, :class:`PlainPath`).

A reducer reduces named flat float32 buckets: ``start`` encodes a bucket and starts its first
collective, ``exchange`` waits for it and starts the next, ``advance`` (a third phase, two-level
reductions only) does the same once more, ``finish`` waits and returns the average. ``exchange``
and ``advance`` do nothing for a phase already started, so ``progress`` (called while the
backward pass still produces later buckets) may have started it earlier: the same work on the
same values, only sooner. Everything
optional is stated here, with a default, so the engine never asks whether a reducer has a part:

=================  ============================================================================
``error_feedback`` whether a step leaves residuals behind (``worker``/``server`` stores)
``layout(n)``      (chunk, padded) length of an n-element bucket's residuals: server, worker side
``store_sizes``    the same per bucket name (default ``layout(n)``; powersgd's depend on shapes)
``set_shapes``     the tensor shapes of each bucket (default: not needed)
``advance``        a third phase (default: none)
``progress``       start the next phase where the previous one is done, never waiting (default:
                   nothing; the phases then start when the engine asks for them)
``state_dict``     what a checkpoint carries; ``load_state_dict`` puts it back
=================  ============================================================================

Example::

    class Halve(Reducer):             # a (useless) reducer: every rank keeps half its own bucket
        def layout(self, n): return 0, 0
        def start(self, name, flat): return flat
        def exchange(self, pend): pass
        def finish(self, pend): return pend / 2
        def state_dict(self): return {}
        def load_state_dict(self, state): pass
"""
from __future__ import annotations

import abc
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

Array = Any


class Store(Protocol):
    """Where a reducer keeps its residuals, by bucket name (:class:`DictStore`; a graph
    framework's store keeps variables that survive across traced steps)."""

    def create(self, name: str, n: int) -> None:
        """Make sure an n-element residual can be set under ``name`` (a graph store makes its
        variable now, before a step is traced; an eager store has nothing to do)."""

    def get(self, name: str) -> Optional[Array]: ...
    def set(self, name: str, value: Array) -> None: ...
    def snapshot(self) -> dict: ...
    def restore(self, data: dict) -> None: ...


class DictStore:
    """Where residuals live: a plain dict of arrays (numpy, torch: eager frameworks).

    A graph framework passes a store that keeps each residual in a variable instead (TF).
    """

    def __init__(self):
        self.data: Dict[str, Array] = {}

    def create(self, name, n):
        """Nothing to make ahead: a residual of another size is ignored when read (see ``layout``)."""

    def get(self, name):
        return self.data.get(name)

    def set(self, name, value):
        self.data[name] = value

    def snapshot(self) -> dict:
        return dict(self.data)

    def restore(self, data: dict) -> None:
        self.data = dict(data)


class PlainPath(Protocol):
    """Horovod's own allreduce of whole tensors (the framework's part): a cast to ``wire`` (or
    the settings' Horovod compressor), the sum or average, the cast back. Sparse gradients go
    through Horovod's sparse path unless the settings say ``sparse_as_dense``."""

    def submit(self, grads: Sequence[Array], name: str, wire: Optional[str]) -> List[Tuple[Any, int]]:
        """Start one allreduce (grouped for several tensors): (pending, bytes handed) per tensor.
        ``wire``: the cast's dtype, or None when the Horovod compressor decides."""

    def finish(self, pending) -> Array:
        """Wait and return the reduced tensor in the gradient's dtype."""

    def is_sparse(self, g: Array) -> bool: ...
    def dense(self, g: Array) -> Array: ...


class Reducer(abc.ABC):
    """Reduces named flat float32 buckets (see the module's table for what is optional).

    Attributes:
        error_feedback: a step leaves residuals in ``worker`` (this rank's whole padded bucket)
            and ``server`` (the part this rank reduces for everybody).
        worker, server: the residual stores (:class:`Store`), by bucket name.
    """

    error_feedback: bool = False
    worker: Store
    server: Store

    @abc.abstractmethod
    def layout(self, n: int) -> Tuple[int, int]:
        """(server-side length, worker-side padded length) of an n-element bucket's residuals."""

    def store_sizes(self, name: str, n: int) -> Tuple[int, int]:
        """:meth:`layout` of bucket ``name``, where the sizes depend on more than ``n``."""
        return self.layout(n)

    def set_shapes(self, shapes: Mapping[str, Sequence[Sequence[int]]]) -> None:
        """The shapes of each bucket's tensors, in order (set with every layout)."""

    @abc.abstractmethod
    def start(self, name: str, flat: Array) -> Any:
        """Encode bucket ``name`` and start its first collective: -> its pending reduction."""

    @abc.abstractmethod
    def exchange(self, pend: Any) -> None:
        """Wait for the first collective, start the second (called for every bucket in turn)."""

    def advance(self, pend: Any) -> None:
        """A third phase, after every bucket's :meth:`exchange` (two levels); default none."""

    def progress(self, pend: Any) -> None:
        """Start the next phase if the collective before it is done (``comm.done``); never
        waits. Default nothing: :meth:`exchange` starts it when the engine asks."""

    @abc.abstractmethod
    def finish(self, pend: Any) -> Array:
        """Wait for the last collective: the bucket's average (flat float32, its n elements)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """What a checkpoint carries: the residuals and what they were made for."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Put back a :meth:`state_dict` (residuals made for another layout are dropped)."""

    @property
    def worker_residual(self) -> dict:
        return self.worker.snapshot()

    @property
    def server_residual(self) -> dict:
        return self.server.snapshot()
