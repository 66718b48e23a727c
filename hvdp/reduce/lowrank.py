"""The low-rank reduction of a bucket (powersgd, ``hvdp.codecs.powersgd``) over allreduce.

A bucket arrives as one flat float32 array; the reducer knows the shapes of its tensors
(``set_shapes``). Per step and bucket, with M a compressed tensor as an n x m matrix (its
error-feedback residual added) and Q its m x r factor:

- ``start``: Q orthonormalised (kept from the step before, or drawn at random), P = M Q; one
  allreduce of every P of the bucket, and one of the bucket's uncompressed tensors;
- ``exchange``: wait for P, orthonormalise it, Q = M^T P, one allreduce of every Q;
- ``finish``: wait, M ~ P Q^T / size; the residual M - P Q^T and the averaged Q are kept.

A driver starts every bucket before it exchanges the first, so all P allreduces are in flight
before any wait (a Horovod cycle costs milliseconds per round), then all Q allreduces. Every
rank gets the same P and Q bits from the allreduces, so every rank computes the same result.

State: the residuals (``worker`` store, bucket name -> flat array) and the warm-start Q
(``server`` store, bucket name -> the bucket's Qs, concatenated). Neither is written in place:
a step sets new arrays, so a driver may keep references to roll a step back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .collectives import AVERAGE, Collectives
from .factors import InitQ, MatrixLayout, matrix_layout, seeded_init
from .reducer import DictStore, Reducer
from .residuals import finite_or_zero
from .stats import WireStats, ring_allreduce_bytes

Array = Any


@dataclass
class _Pending:
    name: str
    n: int
    x: Array                       # the bucket with its residual added
    qs: List[Array]
    p_handle: Any
    plain_handle: Any
    ps: List[Array] = field(default_factory=list)
    q_handle: Any = None
    phase: int = 1
    own: bool = False              # x is this step's own array (not the caller's gradient)
    prev: Any = None               # the state as the step found it: residual, kept Qs (or None)
    kept: Any = None


class LowRankReducer(Reducer):
    """Reduces named flat float32 buckets with a low-rank codec (see the module's docstring).

    Example::

        r = LowRankReducer(get("powersgd", rank=2), NumpyOps(), comm, error_feedback=True)
        r.set_shapes({"b0": [(256, 128), (128,)]})
        pending = r.start("b0", flat)    # P = M Q, allreduce(P)
        r.exchange(pending)              # orthonormalise P, Q = M^T P, allreduce(Q)
        out = r.finish(pending)          # P Q^T / size: the averaged bucket
    """

    def __init__(self, codec, ops, comm: Collectives, error_feedback: bool, op: str = AVERAGE,
                 postscale: float = 1.0, stats: Optional[WireStats] = None,
                 worker_store=None, server_store=None, init_q: Optional[InitQ] = None):
        # settings
        self.codec, self.ops, self.comm = codec, ops, comm
        self.error_feedback, self.op, self.postscale = error_feedback, op, postscale
        self.init_q = init_q if init_q is not None else seeded_init(codec.seed)
        for member in ("matmul", "transpose", "orthonormalize"):
            if not hasattr(ops, member):
                raise ValueError(f"{codec.name} compression needs matrix products, which hvdp's {ops.name} "
                                 "array ops do not provide; use hvdp.torch for powersgd")
        # internal state: residuals and warm-start Qs by bucket name, the buckets' tensor shapes
        self.worker = worker_store if worker_store is not None else DictStore()
        self.server = server_store if server_store is not None else DictStore()
        self._layouts: Dict[str, MatrixLayout] = {}
        # each bucket's first draw (a zero Q column's stand-in), by the (m, r) it was drawn for;
        # kept as numpy: a traced graph cannot use the tensors of another trace
        self._first: Dict[str, Tuple[List[Tuple[int, int]], List[np.ndarray]]] = {}
        # statistics
        self.stats = stats
        if stats is not None:
            stats.path(codec.name, "array ops (matmul)")

    # --- layout -----------------------------------------------------------------------------
    def set_shapes(self, shapes: Dict[str, Sequence[Sequence[int]]]) -> None:
        """The shapes of each bucket's tensors, in the order they lie in its flat array."""
        self._layouts = {name: matrix_layout(self.codec, tensors) for name, tensors in shapes.items()}

    def layout(self, n: int) -> Tuple[int, int]:
        """(server, worker) store sizes of an n-element bucket without known shapes."""
        return 0, n

    def store_sizes(self, name: str, n: int) -> Tuple[int, int]:
        """(server, worker) store sizes of bucket ``name`` (the engine's ``relayout``): its Qs
        and its residual. A store may make them as zeros: a zero Q column means "none yet"."""
        return self._layout_of(name, n).q_len, n

    def _layout_of(self, name: str, n: int) -> MatrixLayout:
        lay = self._layouts.get(name)
        if lay is None:  # no shapes given: the bucket as one vector, uncompressed
            lay = self._layouts[name] = MatrixLayout([], [(0, n)], 0, 0)
        return lay

    # --- one step ---------------------------------------------------------------------------
    def _time(self, phase, t0):
        if self.stats is not None:
            self.stats.time(phase, time.perf_counter() - t0)

    def _wait(self, handle):
        if self.comm.size <= 1:
            return handle
        t0 = time.perf_counter()
        got = self.comm.wait(handle)
        self._time("wire_wait", t0)
        return got

    def _allreduce(self, x, name):
        """Sum over the workers (the caller scales)."""
        return self.comm.allreduce_async(x, name, "sum", 1.0, 1.0) if self.comm.size > 1 else x

    def _draw(self, name, lay) -> List[np.ndarray]:
        drawn = self.init_q(name, [(p.m, p.r) for p in lay.parts])
        return [np.ascontiguousarray(q, dtype=np.float32).reshape(p.m, p.r) for q, p in zip(drawn, lay.parts)]

    def _arrays(self, qs, like) -> List[Array]:
        return [self.ops.from_numpy(q, like=like) for q in qs]

    def _initial_qs(self, name, lay, like) -> Tuple[List[Array], Optional[Array]]:
        """The Qs this step starts from (and the kept ones, or None): the kept ones (warm start),
        else a fresh draw. A kept
        column that is exactly zero (a matrix whose gradient was zero, or a store that made its
        Qs as zeros) takes the bucket's first draw instead: a zero column would stay zero."""
        ops = self.ops
        if not self.codec.warm_start:
            return self._arrays(self._draw(name, lay), like), None
        dims = [(p.m, p.r) for p in lay.parts]
        if self._first.get(name, (None,))[0] != dims:  # none yet, or the bucket's tensors changed
            self._first[name] = (dims, self._draw(name, lay))
        first = self._arrays(self._first[name][1], like)
        kept = self.server.get(name)
        if kept is None or ops.size(kept) != lay.q_len:
            return first, None
        out = []
        for p, q0 in zip(lay.parts, first):
            q = ops.reshape(kept[p.q_off:p.q_off + p.m * p.r], (p.m, p.r))
            ones = ops.reshape(ops.zeros(p.m, "float32", like=q) + 1.0, (1, p.m))
            # (1, r): each column's sum of |q|, zero only for a zero column (q * q underflowed to
            # zero below ~1e-19: a tiny matrix lost its warm start)
            out.append(ops.where(ops.matmul(ones, ops.abs(q)) > 0, q, q0))
        return out, kept

    def _matrix(self, x, p):
        return self.ops.reshape(x[p.offset:p.offset + p.n * p.m], (p.n, p.m))

    def start(self, name: str, flat: Array) -> _Pending:
        ops, t0 = self.ops, time.perf_counter()
        n = ops.size(flat)
        lay = self._layout_of(name, n)
        x, own = flat, False
        prev = self.worker.get(name) if self.error_feedback else None
        if prev is not None and ops.size(prev) == n:
            x, own = flat + prev, True  # a new array: ``flat`` may be the gradient itself
        else:
            prev = None
        start_qs, kept = self._initial_qs(name, lay, flat)
        qs = [ops.orthonormalize(q) for q in start_qs]
        ps = [ops.matmul(self._matrix(x, p), q) for p, q in zip(lay.parts, qs)]
        self._time("encode", t0)
        p_handle = self._allreduce(ops.cat(ps), f"hvdp.psgd.p.{name}") if ps else None
        plain_handle = None
        if lay.plain:
            plain = x[lay.plain[0][0]:lay.plain[0][0] + lay.plain[0][1]] if len(lay.plain) == 1 else \
                ops.cat([x[o:o + k] for o, k in lay.plain])
            plain_handle = self._allreduce(plain, f"hvdp.psgd.u.{name}")
        self._record(lay, n)
        return _Pending(name, n, x, qs, p_handle, plain_handle, own=own, prev=prev, kept=kept)

    def _record(self, lay, n):
        if self.stats is None:
            return
        p = self.comm.size
        compressed = sum(part.n * part.m for part in lay.parts)
        if lay.parts:
            factors = 4 * (lay.p_len + lay.q_len)
            self.stats.record(self.codec.name, compressed, handed=factors,
                              sent=ring_allreduce_bytes(4 * lay.p_len, p) + ring_allreduce_bytes(4 * lay.q_len, p),
                              fp32=ring_allreduce_bytes(4 * compressed, p))
        if n - compressed:
            self.stats.record_allreduce("none", n - compressed, 4 * (n - compressed), p)

    def progress(self, pend: _Pending) -> None:
        if pend.phase == 1 and (pend.p_handle is None or self.comm.size == 1 or self.comm.done(pend.p_handle)):
            self.exchange(pend)

    def exchange(self, pend: _Pending) -> None:
        if pend.phase != 1:  # started already (progress)
            return
        ops, lay = self.ops, self._layouts[pend.name]
        if lay.parts:
            got = self._wait(pend.p_handle)
            t0 = time.perf_counter()
            pend.ps = [ops.orthonormalize(ops.reshape(got[p.p_off:p.p_off + p.n * p.r], (p.n, p.r)))
                       for p in lay.parts]
            # Q = M^T P computed as (P^T M)^T: M read in its own row order (3x faster on a CPU)
            qs = [ops.transpose(ops.matmul(ops.transpose(pp), self._matrix(pend.x, p)))
                  for p, pp in zip(lay.parts, pend.ps)]
            self._time("owner", t0)
            pend.q_handle = self._allreduce(ops.cat(qs), f"hvdp.psgd.q.{pend.name}")
        pend.p_handle = None
        pend.phase = 2

    def finish(self, pend: _Pending) -> Array:
        """Wait for Q (and the uncompressed tensors): the averaged bucket, the same bits on
        every rank. With error feedback, the residual is the bucket (its previous residual
        added) minus the low-rank approximation of the average; zero for the uncompressed
        tensors. A result that is not finite keeps the step's residual and Q out (the step a
        loss scaler skips leaves no trace)."""
        if pend.phase == 1:
            self.exchange(pend)
        ops, lay, p = self.ops, self._layouts[pend.name], self.comm.size
        avg = 1.0 / p if self.op == AVERAGE else 1.0  # of Q; a sum is p times the average
        q_sum = self._wait(pend.q_handle) if lay.parts else None
        plain = self._wait(pend.plain_handle) if lay.plain else None
        t0 = time.perf_counter()
        q_avg = q_sum * (1.0 / p) if q_sum is not None else None
        approx = {}  # offset -> the part's approximation of the average (x's scale)
        for part, pp in zip(lay.parts, pend.ps):
            q = ops.reshape(q_avg[part.q_off:part.q_off + part.m * part.r], (part.m, part.r))
            approx[part.offset] = ops.reshape(ops.matmul(pp, ops.transpose(q)), (part.n * part.m,))
        scale = self.postscale * (p * avg)
        pieces = [(o, approx[o] * scale if scale != 1.0 else approx[o]) for o in approx]
        off = 0
        for o, k in lay.plain:
            part = plain[off:off + k]
            pieces.append((o, part * (self.postscale * avg) if self.postscale * avg != 1.0 else part))
            off += k
        out = ops.assemble(pend.n, "float32", pieces, like=pend.x)
        self._keep(pend, lay, approx, q_avg, None if ops.all_finite(out) else out)
        self._time("final_decode", t0)
        pend.x = pend.qs = pend.ps = pend.prev = pend.kept = None
        return out

    def _keep(self, pend, lay, approx, q_avg, unsure=None):
        """The new residual and Qs. ``unsure``: the result, when it is not known to be finite
        (it is not, or a graph being traced cannot look): the state is then a select,
        ``where(finite, new, as the step found it)``, decided from the result's bits, the same on
        every rank (a state that did not exist comes back as zeros: "none yet" for the Qs)."""
        ops, keep = self.ops, []
        if self.error_feedback:
            # x - P Q^T may overflow where the approximation overshoots a huge x: those elements
            # are dropped from the residual, as the two-phase codecs' (finite_or_zero)
            keep.append((self.worker, finite_or_zero(ops, self._residual(pend, lay, approx)), pend.prev))
        if self.codec.warm_start and q_avg is not None:
            keep.append((self.server, q_avg, pend.kept))
        bad = None
        if unsure is not None:
            n = ops.size(unsure)
            bad = ops.amax_rows(ops.reshape(ops.where(ops.isfinite(unsure), 0.0, 1.0), (1, n))) > 0  # (1,)
        for store, new, old in keep:
            if bad is not None:
                old = old if old is not None else ops.zeros(ops.size(new), "float32", like=new)
                new = ops.where(bad, old, new)
            store.set(pend.name, new)

    def _residual(self, pend, lay, approx):
        """x - P Q^T on the compressed tensors, zero on the others. Where x is this step's own
        array and the ops write in place into its slices (numpy, torch), x becomes the residual:
        no new bucket-sized array (each is page faults and a copy); else one is assembled."""
        ops, x = self.ops, pend.x
        if pend.own and ops.writable_views:
            parts = [(x[o:o + ops.size(a)], a) for o, a in approx.items()] + [(x[o:o + k], None) for o, k in lay.plain]
            for part, a in parts:  # a: this step's own approximation, no longer needed
                got = ops.mul_(part, 0.0) if a is None else ops.add_(part, ops.mul_(a, -1.0))
                if got is not part:
                    raise RuntimeError(f"{ops.name} ops say writable_views but add_/mul_ did not write in place")
            return x
        pieces = [(o, x[o:o + ops.size(a)] - a) for o, a in approx.items()]
        return ops.assemble(pend.n, "float32", pieces + [(o, ops.zeros(k, "float32", like=x)) for o, k in lay.plain],
                            like=x)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"codec": str(self.codec), "size": self.comm.size,
                "worker": self.worker.snapshot(), "server": self.server.snapshot()}

    def load_state_dict(self, state: dict) -> None:
        """Residuals and warm-start Qs come back where the codec is the same (their sizes follow
        the tensors, not the number of workers); a bucket whose layout changed ignores them."""
        same = state.get("codec") == str(self.codec)
        self.worker.restore(dict(state.get("worker", {})) if same else {})
        self.server.restore(dict(state.get("server", {})) if same else {})
