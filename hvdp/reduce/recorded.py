"""Every collective an engine runs, written into the flight record (``hvdp.cluster.flight``).

The :class:`~hvdp.reduce.engine.Engine` wraps what an adapter passes in: its collectives
(:class:`Recorded`: the reducers' alltoall / allgather / allreduce, the two levels' and auto's
probe), its plain path (:class:`RecordedPlain`: Horovod's allreduce of whole tensors) and its
fixed-size allgather (:func:`recorded_gather`: the ranks-agree check). So every adapter's
collectives pass through one place. A submit is recorded once it returned, its end when its wait
returned or raised; a submit that raised (Horovod already shut down) is recorded as refused. While a step is
traced into a graph (Keras on TensorFlow) nothing is recorded: those collectives run later,
inside TensorFlow's executor.

Example::

    comm = Recorded(comm, ops, codec=lambda: "int8", step=lambda: eng.step)
    h = comm.alltoall_async(buf, "hvdp.a2a.b0")     # recorded: started
    out = comm.wait(h)                              # recorded: done
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..cluster.flight import RECORDER, REFUSED, FlightRecorder

ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
            "int16": 2, "uint8": 1, "int8": 1, "bool": 1}


class Flying:
    """A handle (or a plain path's pending) with its flight record; only its wrapper unwraps it."""
    __slots__ = ("inner", "rec")

    def __init__(self, inner, rec):
        self.inner, self.rec = inner, rec


class _Recording:
    def __init__(self, ops, codec: Callable[[], str], step: Callable[[], int],
                 tracing: Callable[[], bool], recorder: Optional[FlightRecorder]):
        self._ops, self._codec, self._step, self._tracing = ops, codec, step, tracing
        self._rec = RECORDER if recorder is None else recorder

    def _nbytes(self, x) -> int:
        n = getattr(x, "nbytes", None)  # numpy and torch: one attribute read
        if type(n) is int:
            return n
        try:
            return int(self._ops.size(x)) * ITEMSIZE.get(self._ops.dtype(x), 4)
        except Exception:
            return -1

    def _end(self, flying: Flying, wait: Callable[[Any], Any]):
        return self._rec.waited(flying.rec, lambda: wait(flying.inner))

    def _refused(self, name: str, phase: str, nbytes: int) -> None:
        """A submit that raised: this rank got there; the collective never started."""
        if not self._tracing():
            self._rec.end(self._rec.start(name, self._codec(), phase, nbytes, self._step()), REFUSED)


class Recorded(_Recording):
    """An adapter's collectives (``hvdp.reduce.collectives.Collectives``), each one recorded;
    anything else (``scope``, ``process_set``) is the inner object's."""

    def __init__(self, inner, ops, codec: Callable[[], str], step: Callable[[], int] = lambda: -1,
                 tracing: Callable[[], bool] = lambda: False, recorder: Optional[FlightRecorder] = None):
        super().__init__(ops, codec, step, tracing, recorder)
        self.inner = inner
        self._scope = getattr(inner, "scope", "")

    def __getattr__(self, k):
        return getattr(self.inner, k)

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def rank(self) -> int:
        return self.inner.rank

    def _submit(self, submit: Callable[[], Any], phase: str, name: str, x):
        if self._tracing():
            return submit()
        h, rec = self._rec.submitted(submit, self._scope + name, self._codec(), phase, self._nbytes(x),
                                     self._step())
        return h if rec is None else Flying(h, rec)

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return self._submit(lambda: self.inner.allreduce_async(x, name, op, prescale, postscale),
                            "allreduce", name, x)

    def alltoall_async(self, buf, name):
        return self._submit(lambda: self.inner.alltoall_async(buf, name), "alltoall", name, buf)

    def allgather_async(self, buf, name):
        return self._submit(lambda: self.inner.allgather_async(buf, name), "allgather", name, buf)

    def wait(self, handle):
        if type(handle) is not Flying:
            return self.inner.wait(handle)
        return self._end(handle, self.inner.wait)

    def done(self, handle) -> bool:
        return self.inner.done(handle.inner if type(handle) is Flying else handle)


class RecordedPlain(_Recording):
    """A plain path (``hvdp.reduce.reducer.PlainPath``) whose submits are recorded: one record
    per submit (a grouped allreduce is one collective), ended by its first finished tensor."""

    def __init__(self, inner, ops, codec: Callable[[], str], step: Callable[[], int] = lambda: -1,
                 tracing: Callable[[], bool] = lambda: False, recorder: Optional[FlightRecorder] = None,
                 scope: str = ""):
        super().__init__(ops, codec, step, tracing, recorder)
        self.inner, self._scope = inner, scope

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def submit(self, grads, name: str, wire: Optional[str]) -> list:
        phase = f"allreduce ({wire or 'as given'}{f', {len(grads)} tensors' if len(grads) > 1 else ''})"
        try:
            out = self.inner.submit(grads, name, wire)
        except BaseException:
            self._refused(self._scope + name, phase, sum(self._nbytes(g) for g in grads))
            raise
        if self._tracing():
            return out
        rec = self._rec.start(self._scope + name, self._codec(), phase, sum(n for _, n in out), self._step())
        return out if rec is None else [(Flying(p, rec), n) for p, n in out]

    def finish(self, pend):
        if type(pend) is not Flying:
            return self.inner.finish(pend)
        return self._end(pend, self.inner.finish)


def recorded_gather(gather: Callable[[bytes, str], List[bytes]], step: Callable[[], int] = lambda: -1,
                    tracing: Callable[[], bool] = lambda: False,
                    recorder: Optional[FlightRecorder] = None) -> Callable[[bytes, str], List[bytes]]:
    """A fixed-size allgather (``(bytes, name) -> [every rank's bytes]``, blocking), recorded."""
    rec_of = RECORDER if recorder is None else recorder

    def run(data: bytes, name: str) -> List[bytes]:
        if tracing():
            return gather(data, name)
        rec = rec_of.start(name, "none", "allgather (bytes)", len(data), step())
        return rec_of.waited(rec, lambda: gather(data, name))
    return run
