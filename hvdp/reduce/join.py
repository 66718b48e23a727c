"""Uneven inputs: a rank that runs out of data calls ``hvd.join()`` and the others go on.

Horovod's join answers only *allreduce* for a joined rank (with zeros); an alltoall or allgather
that meets a joined rank is an error on the active ranks and crashes the joined one. hvdp's
two-phase codecs (bf16, int8, int4, topk) use exactly those. So, wherever it is supported (the
default ``DistributedOptimizer(..., uneven_inputs=None)``: a flat reduction with a two-phase
codec; :class:`~hvdp.reduce.settings.ReduceSettings` decides it once, for every adapter):

- every step, before its first two-phase bucket, the ranks sum a 1 over an allreduce
  (``CONTROL_NAME``): a joined rank's zero makes the sum smaller than the size, and every active
  rank sees the same number, so all take the same path;
- in a step where some rank has joined, each two-phase bucket is reduced by one float32
  allreduce instead (:class:`JoinableReducer`), which Horovod's join supports.

The average is Horovod's in every case: the sum over the active ranks divided by the full size
(a joined rank adds zeros), for every codec. Error feedback while a rank has joined:

- an active rank sends its gradient *plus* its worker residual exactly (float32), so its worker
  residual becomes zero (nothing of it was lost); a joined rank sends nothing and keeps its own;
- server residuals (each rank's share of the re-encoding error of the chunk it owns) are left as
  they are on every rank: no chunk is re-encoded in such a step, so no new error arises, and each
  is added by its owner at the next two-phase step;
- a step whose result is not finite (a loss scaler skips it) puts the worker residual back, as
  a two-phase step does (``hvdp.reduce.residuals.keep_if_finite``).

After all ranks have joined, hvdp's ``join`` broadcasts the optimizers' parameters and state from
the last rank to join (it ran every step), so the ranks are identical again.

Where the control is off, ``join`` on a rank whose optimizer has two-phase (or low-rank, or
two-level) buckets raises :class:`JoinRefused` naming why (the other ranks learn it through the
failure reports, see ``hvdp.cluster.failures``) instead of letting Horovod crash or hang: the user passed
``uneven_inputs=False``, the codec is low-rank (powersgd), the reduction is ``hierarchical=True``,
or the gradients come from Keras' ``DistributedGradientTape``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from ..codecs.base import get
from .collectives import AVERAGE, allreduce_recorded
from .reducer import Reducer
from .residuals import keep_if_finite

CONTROL_NAME = "hvdp.join.active"


class JoinRefused(RuntimeError):
    """``hvd.join()`` while an optimizer's join control is off (:func:`refusal` says why)."""


def _low_rank(codec_name: str) -> bool:
    try:
        return bool(getattr(get(codec_name), "low_rank", False))
    except (TypeError, ValueError):  # "auto", "horovod": not a registered codec
        return False


def refusal(codec_name: str, adapter: str, why: str = "off") -> str:
    """The message of :class:`JoinRefused`: what happened, why, and the ways out.

    ``why`` (``ReduceSettings.join_off``, or "tape" for Keras' ``DistributedGradientTape``):
    "off" (``uneven_inputs=False`` was passed), "low_rank", "hierarchical", "tape"."""
    if why not in ("off", "low_rank", "hierarchical", "tape"):
        raise ValueError(f"refusal: unknown reason {why!r}")
    head = "hvd.join() was called (this rank ran out of data) while the DistributedOptimizer uses "
    even = "give every rank the same number of steps (drop the remainder of the data)"
    if why == "low_rank" or (why == "off" and _low_rank(codec_name)):
        return (f"{head}{codec_name} compression, which does not support uneven inputs (its warm-start and "
                f"error-feedback state assumes every rank runs every step). Fix: {even}, or use "
                f"compression 'int8' (hvd.join() then works without any other argument).")
    if why == "hierarchical":
        return (f"{head}hierarchical=True ({codec_name} between nodes), which does not support uneven "
                f"inputs: a joined rank would leave its node's reduce-scatter waiting. Fix: {even}, or use "
                f"hierarchical=False (hvd.join() then works with every codec).")
    if why == "tape":
        return (f"hvd.join() was called (this rank ran out of data) while a DistributedGradientTape uses "
                f"{codec_name} compression, which reduces over alltoall/allgather: Horovod's join does not "
                f"support those and would crash, and the tape has no join control. Fix: use "
                f"hvd.DistributedOptimizer (hvd.join() works with every codec there); or {even}, or use "
                f"compression 'none' or 'fp16' with the tape.")
    extra = (" (hvd.callbacks.JoinCallback() in model.fit's callbacks)" if adapter == "keras" else "")
    return (f"{head}{codec_name} compression, which reduces over alltoall/allgather, and was created "
            f"with uneven_inputs=False, which turns off the per-step join control: Horovod's join does not "
            f"support those collectives and would crash. Fix: drop uneven_inputs=False on every rank (the "
            f"default turns the control on for this codec, and hvd.join(){extra} then works); or {even}, "
            f"or use compression 'none' or 'fp16'.")


def someone_joined(active: float, size: int) -> bool:
    """From the control sum (a 1 per active rank, 0 per joined rank): has any rank joined?"""
    n = int(round(float(active)))
    if not 1 <= n <= size:
        raise RuntimeError(f"hvdp join control: {n} active ranks of {size}; the ranks disagree on "
                           "uneven_inputs (it must be set the same way on every rank: leave it at "
                           "its default everywhere)")
    return n < size


@dataclass
class _JoinedPending:
    name: str
    n: int
    handle: Any
    prev: Any = None  # the worker residual before the step (zeroed by it)


class JoinableReducer(Reducer):
    """A :class:`~hvdp.reduce.twophase.TwoPhaseReducer` that switches a step's buckets to one float32
    allreduce while ``joined()`` says some rank has joined. Otherwise it is the inner reducer
    (state, layout and residual stores are the inner one's).

    Example::

        r = JoinableReducer(TwoPhaseReducer(codec, ops, comm, True), joined=control.joined)
        pending = r.start("b0", flat); r.exchange(pending); out = r.finish(pending)
    """

    def __init__(self, inner, joined: Callable[[], bool]):
        self.inner = inner
        self.joined = joined
        self.worker, self.server = inner.worker, inner.server
        self.error_feedback = inner.error_feedback

    # the inner reducer's parts, as the contract names them
    @property
    def codec(self):
        return self.inner.codec

    def layout(self, n: int):
        return self.inner.layout(n)

    def store_sizes(self, name: str, n: int):
        return self.inner.store_sizes(name, n)

    def set_shapes(self, shapes) -> None:
        self.inner.set_shapes(shapes)

    def advance(self, pend) -> None:
        if not isinstance(pend, _JoinedPending):
            self.inner.advance(pend)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def start(self, name: str, flat):
        if not self.joined():
            return self.inner.start(name, flat)
        r = self.inner
        ops = r.ops
        n = ops.size(flat)
        _, padded = r.layout(n)
        x = flat if padded == n else ops.cat([flat, ops.zeros(padded - n, "float32", like=flat)])
        prev = r.worker.get(name) if r.error_feedback else None
        if prev is not None and ops.size(prev) == padded:
            x = x + prev
            r.worker.set(name, ops.zeros(padded, "float32", like=flat))  # sent whole: nothing owed
        else:
            prev = None
        handle = allreduce_recorded(r.comm, x, f"hvdp.join.{name}", r.op, r.postscale, r.stats, "none", n,
                                    4 * padded)
        return _JoinedPending(name, n, handle, prev)

    def exchange(self, pend) -> None:
        if not isinstance(pend, _JoinedPending):
            self.inner.exchange(pend)

    def progress(self, pend) -> None:
        if not isinstance(pend, _JoinedPending):
            self.inner.progress(pend)

    def finish(self, pend):
        if not isinstance(pend, _JoinedPending):
            return self.inner.finish(pend)
        out = self.inner.comm.wait(pend.handle)
        if pend.prev is not None:
            keep_if_finite(self.inner.ops, pend.name, out, ((self.inner.worker, pend.prev),))
        return out[:pend.n]


def joined_average(contributions: List[Any], active: List[bool], op: str = AVERAGE):
    """The reference: Horovod's average while some ranks have joined (numpy or any array type):
    the sum of the active ranks' contributions divided by the full number of ranks."""
    total = sum(c for c, a in zip(contributions, active) if a)
    return total / len(contributions) if op == AVERAGE else total


class Registry:
    """The optimizers ``hvd.join()`` must bring back in line, in creation order (the same on
    every rank); held weakly, so a dropped optimizer drops out."""

    def __init__(self):
        self._refs: List[Tuple[int, weakref.ref]] = []
        self._made = 0

    def add(self, obj) -> None:
        self._refs = [(n, r) for n, r in self._refs if r() is not None] + [(self._made, weakref.ref(obj))]
        self._made += 1

    def _numbered(self) -> list:
        return [(n, o) for n, o in ((n, r()) for n, r in self._refs) if o is not None]

    def alive(self) -> list:
        return [o for _, o in self._numbered()]

    def alive_on_every_rank(self, allgather_object, name: str) -> list:
        """The optimizers alive on every rank (a collective: call it on all ranks, after the
        join). A dropped optimizer can stay alive on one rank and not on another (a framework
        cache may hold it until some later collection); broadcasting its variables on some
        ranks only would be a mismatched collective. Optimizers are told apart by their creation
        number, the same on every rank of one script."""
        mine = self._numbered()
        every = allgather_object([n for n, _ in mine], name=name)
        common = set(every[0]).intersection(*every[1:])
        return [o for n, o in mine if n in common]
