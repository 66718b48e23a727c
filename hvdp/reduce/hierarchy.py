"""Two-level reduction: full precision inside a node, the codec between nodes.

A cluster has a fast link inside each node (shared memory, NVLink) and a slower one between
nodes. The flat two-phase reduction sends every rank's chunks over the slow link; with L ranks
per node and C nodes, :class:`HierarchicalReducer` sends about 1/L of that across nodes:

1. inside the node (the *local* process set, L ranks): a float32 reduce-scatter (an alltoall
   of L equal shares, each rank summing the share it owns in rank order);
2. between nodes (the *cross* process set: the C ranks with the same local rank): the share
   is reduced with the codec — the two-phase reduction of ``hvdp.reduce.twophase`` with its error
   feedback for a two-phase codec, one allreduce in the codec's wire dtype for a summable one
   (none, fp16);
3. inside the node again: an allgather of the reduced shares.

Every rank ends with the same bits: the ranks of one cross set decode the same bytes, and
the final allgather hands the same shares to every rank of a node.

The groups (which ranks share a node, and their process sets) are ``hvdp.cluster.topology``'s.

Example::

    red = HierarchicalReducer(get("int8"), NumpyOps(), local_comm, cross_comm, error_feedback=True)
    pend = red.start("b0", flat); red.exchange(pend); out = red.finish(pend)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

from .collectives import AVERAGE, allreduce_recorded
from .stats import ring_allreduce_bytes
from .reducer import DictStore, Reducer
from .twophase import TwoPhaseReducer, chunk_length

Array = Any


class _SummedCross(Reducer):
    """The cross-node step of a summable codec: one allreduce of the share in its wire dtype."""

    def __init__(self, codec, ops, comm, op, postscale, stats):
        self.codec, self.ops, self.comm = codec, ops, comm
        self.op, self.postscale, self.stats = op, postscale, stats
        self.error_feedback = False
        self.worker, self.server = DictStore(), DictStore()

    def layout(self, n):
        return 0, 0

    def start(self, name, share):
        n, c = self.ops.size(share), self.codec
        x = share if c.wire_dtype == "float32" else self.ops.cast(share, c.wire_dtype)
        return allreduce_recorded(self.comm, x, f"hvdp.hx.{name}", self.op, self.postscale, self.stats,
                                  c.name, n, c.payload_nbytes(n))

    def exchange(self, pend):
        pass

    def finish(self, pend):
        out = self.comm.wait(pend) if self.comm.size > 1 else pend
        return out if self.codec.wire_dtype == "float32" else self.ops.cast(out, "float32")

    def state_dict(self):
        return {"codec": str(self.codec), "size": self.comm.size, "worker": {}, "server": {}}

    def load_state_dict(self, state):
        pass


class _Counted:
    """A statistics sink for the cross step: its bytes kept aside (the two-level reducer records
    the whole bucket once), its phase times and kernel path passed on."""

    def __init__(self, stats):
        self.stats = stats
        self.rows: List[Tuple[int, int, float]] = []  # (elements, handed, sent) per record

    def record(self, codec, elements, handed, sent, fp32):
        self.rows.append((elements, handed, sent))

    def record_allreduce(self, codec, elements, nbytes, p):
        self.rows.append((elements, nbytes, ring_allreduce_bytes(nbytes, p)))

    def time(self, phase, seconds):
        if self.stats is not None:
            self.stats.time(phase, seconds)

    def path(self, *a):
        if self.stats is not None:
            self.stats.path(*a)

    def take(self) -> Tuple[int, float]:
        handed = sum(r[1] for r in self.rows)
        sent = sum(r[2] for r in self.rows)
        self.rows.clear()
        return handed, sent


@dataclass
class _Pending:
    name: str
    n: int
    share: int
    handle: Any
    phase: int = 1
    inner: Any = None


class HierarchicalReducer(Reducer):
    """Reduces named flat float32 buckets in two levels (see the module's docstring); the
    interface of :class:`~hvdp.reduce.twophase.TwoPhaseReducer` (start / exchange / finish, residual
    stores, state), so the engine drives it unchanged.

    Args:
        codec: the codec between nodes (any, ``none`` included).
        local, cross: collectives over this rank's node and over its cross set.
        error_feedback: residuals for a two-phase codec (worker: this rank's share; server: the
            chunk of the share it owns across nodes).
        op, postscale: the average over every rank (or the sum), then ``postscale``.
        stats: a ``WireStats``: every bucket recorded once, with the bytes that cross nodes
            as ``cross``.
    """

    def __init__(self, codec, ops, local, cross, error_feedback: bool, op: str = AVERAGE,
                 postscale: float = 1.0, stats=None, worker_store=None, server_store=None, wrap=None):
        self.codec, self.ops, self.local, self.cross = codec, ops, local, cross
        self.op, self.postscale, self.stats = op, postscale, stats
        self._inner_stats = _Counted(stats)
        # the cross step sums over the nodes; the node's own sum is divided here, so the
        # result is the average over every rank
        post = postscale / local.size if op == AVERAGE else postscale
        if codec.summable:
            self.inner = _SummedCross(codec, ops, cross, op, post, self._inner_stats)
        else:
            run = wrap(codec) if wrap is not None else codec
            self.inner = TwoPhaseReducer(run, ops, cross, error_feedback, op, post, self._inner_stats,
                                         worker_store, server_store)
        self.error_feedback = self.inner.error_feedback
        self.worker, self.server = self.inner.worker, self.inner.server

    def share_length(self, n: int) -> int:
        """Length of each rank's share of an n-element bucket inside its node."""
        return chunk_length(n, self.local.size, self.codec.align)

    def layout(self, n: int):
        """(server residual length, worker residual length) of an n-element bucket."""
        return self.inner.layout(self.share_length(n))

    def start(self, name: str, flat: Array) -> _Pending:
        ops, size = self.ops, self.local.size
        n = ops.size(flat)
        s = self.share_length(n)
        if s * size != n:
            flat = ops.cat([flat, ops.zeros(s * size - n, "float32", like=flat)])
        handle = self.local.alltoall_async(flat, f"hvdp.hl.{name}") if size > 1 else flat
        return _Pending(name, n, s, handle)

    def progress(self, pend: _Pending) -> None:
        if pend.phase == 1 and (self.local.size == 1 or self.local.done(pend.handle)):
            self.exchange(pend)
        if pend.phase == 2:  # the cross step's second phase, where its first is done
            self.inner.progress(pend.inner)

    def exchange(self, pend: _Pending) -> None:
        """Wait for the node's shares, sum this rank's, start the cross step."""
        if pend.phase != 1:  # started already (progress)
            return
        ops, size, s = self.ops, self.local.size, pend.share
        recv = self.local.wait(pend.handle) if size > 1 else pend.handle
        recv = ops.reshape(recv, [s * size])  # a static shape again (a traced graph's collective has none)
        acc = recv[0:s]
        for j in range(1, size):  # rank order: the owner's sum is deterministic
            acc = ops.add_(acc, recv[j * s:(j + 1) * s])
        pend.inner = self.inner.start(pend.name, acc)
        pend.phase = 2

    def advance(self, pend: _Pending) -> None:
        """The cross step's second phase (wait, the owner's work, the allgather started): called
        for every bucket before the first ``finish``, so buckets overlap on the slow link."""
        if pend.phase == 1:
            self.exchange(pend)
        if pend.phase == 2:
            self.inner.exchange(pend.inner)
            pend.phase = 3

    def finish(self, pend: _Pending) -> Array:
        self.advance(pend)
        ops, size, s = self.ops, self.local.size, pend.share
        share = self.inner.finish(pend.inner)
        if ops.size(share) != s:
            share = share[:s]
        out = self.local.wait(self.local.allgather_async(share, f"hvdp.hg.{pend.name}")) if size > 1 else share
        out = ops.reshape(out, [s * size])
        if self.stats is not None:
            handed, cross = self._inner_stats.take()
            p = size * self.cross.size
            # inside the node: the alltoall's L shares and the allgather's one, float32;
            # each sends (L-1) shares
            inside = 4 * s * (size + 1) if size > 1 else 0
            self.stats.record(self.codec.name, pend.n, handed=handed + inside,
                              sent=cross + 2.0 * (size - 1) * 4 * s, fp32=ring_allreduce_bytes(4 * pend.n, p),
                              cross=cross)
        return out[:pend.n]

    # --- state ------------------------------------------------------------------------------
    def levels(self) -> List[int]:
        return [self.local.size, self.cross.size, self.local.rank]

    def state_dict(self) -> dict:
        return dict(self.inner.state_dict(), levels=self.levels())

    def load_state_dict(self, state: dict) -> None:
        """Residuals come back only where the node layout and this rank's place in it are the
        same (the share, and so the residual, belongs to the local rank)."""
        if state.get("levels") != self.levels():
            state = {"codec": state.get("codec")}
        self.inner.load_state_dict(state)
