"""Two-phase compressed allreduce (reduce-scatter by alltoall, then allgather), with error feedback.

Horovod's compressor contract sums the compressed tensors, which is wrong for any codec with
per-worker scales. Here every worker splits its (flattened, residual-corrected) bucket into P
equal chunks and encodes each; an ``alltoall`` gives rank r every worker's chunk r, which it
decodes and sums in float32; it re-encodes that reduced chunk (keeping a server-side residual)
and an ``allgather`` hands every rank every reduced chunk. All ranks decode the same bytes, so
they end bit-identical. Per worker 2(P-1)/P * N * b bytes are sent (b bytes per element).

Where fused kernels serve the codec on the bucket's device (``hvdp.kernels.select``), each phase
is one kernel call per chunk: encode with the residual straight into the send buffer,
decode-and-sum of the received payloads, decode straight into the result. Arrays that cannot be
written in place but can be read on the host (TensorFlow's eager tensors) are *staged*: each
phase copies its input to numpy once, runs the kernels there and wraps the result (the path is
then reported as e.g. ``cpu-c (host copies)``). Otherwise (a graph being traced, top-k, no
compiler) the codec's array ops run. All paths give the same bits. The time of
each phase (encode, wire wait, owner work, final decode) goes to ``WireStats``.

A step whose reduced bucket is not finite (a loss scaler's overflow: ``torch.amp.GradScaler``
or Keras's ``LossScaleOptimizer`` then skips it) leaves that bucket's residuals as they were
before the step, on every rank: the decision is read from the decoded bucket, the same bytes
everywhere (see :meth:`TwoPhaseReducer.finish`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from .collectives import AVERAGE, Collectives
from .reducer import DictStore, Reducer
from .residuals import finite_or_zero, keep_if_finite, previous
from .staging import KernelPaths
from .stats import WireStats, ring_allreduce_bytes, two_phase_bytes

Array = Any


def chunk_length(n: int, p: int, align: int) -> int:
    """Length of each of the P chunks: ceil(n / P) rounded up to ``align``."""
    per = -(-n // p)
    return max(align, -(-per // align) * align)


@dataclass
class _Pending:
    name: str
    n: int
    chunk: int
    handle: Any
    phase: int = 1
    own: Any = None        # this rank's own chunk as decoded for the residual: reused, not decoded again
    own_final: Any = None  # likewise for the reduced chunk this rank owns
    kernels: Any = None    # the fused kernels of this bucket, or None: array ops
    staged: bool = False   # the kernels run on host (numpy) copies of the framework's arrays
    # the residuals before this step (error feedback): put back if its result is not finite
    prev_worker: Any = None
    prev_server: Any = None


class TwoPhaseReducer(Reducer):
    """Reduces named flat float32 buckets with one codec. Holds the error-feedback residuals.

    Example::

        r = TwoPhaseReducer(get("int8"), NumpyOps(), comm, error_feedback=True)
        pending = r.start("b0", flat)       # encode + alltoall (async)
        r.exchange(pending)                 # wait, decode, sum, re-encode + allgather (async)
        out = r.finish(pending)             # wait, decode: the averaged bucket
    """

    def __init__(self, codec, ops, comm: Collectives, error_feedback: bool,
                 op: str = AVERAGE, postscale: float = 1.0, stats: Optional[WireStats] = None,
                 worker_store=None, server_store=None):
        self.codec, self.ops, self.comm = codec, ops, comm
        self.error_feedback = error_feedback
        self.op, self.postscale = op, postscale
        self.stats = stats
        # internal state: residuals by bucket name (worker side: this rank's whole padded
        # bucket; server side: the chunk this rank reduces)
        self.worker = worker_store if worker_store is not None else DictStore()
        self.server = server_store if server_store is not None else DictStore()
        self.paths = KernelPaths(codec, ops, stats)  # the fused kernels by device, or none

    def kernels_for(self, like):
        """The fused kernels for buckets like ``like`` (chosen once per device and dtype), or None."""
        return self.paths.choose(like)[0]

    def _time(self, phase, t0):
        if self.stats is not None:
            self.stats.time(phase, time.perf_counter() - t0)

    def _wait(self, handle):
        t0 = time.perf_counter()
        got = self.comm.wait(handle)
        self._time("wire_wait", t0)
        return got

    def layout(self, n: int):
        """(chunk length, padded length) of an n-element bucket: the residuals' sizes."""
        c = chunk_length(n, self.comm.size, self.codec.align)
        return c, c * self.comm.size

    def _encode_with_feedback(self, x, store, name, prev):
        """Encode x (+ ``prev``, the residual kept under ``name``, or None); keep the new residual.
        Returns the payload and, with error feedback, its decoded value (else None)."""
        if not self.error_feedback:
            return self.codec.encode(self.ops, x), None
        ops, c = self.ops, self.codec
        if prev is not None:
            x = ops.add_(x, prev)  # x: the caller's temporary
        payload = c.encode(ops, x)
        decoded = c.decode(ops, payload, ops.size(x))
        # a non-finite element must not poison every later step through the residual
        store.set(name, finite_or_zero(self.ops, x - decoded))
        return payload, decoded

    def _chunk(self, flat, i, c, n, ops=None):
        """Chunk i of the zero-padded bucket, padding only the one chunk that needs it."""
        ops = ops or self.ops
        lo, hi = i * c, (i + 1) * c
        if hi <= n:
            return flat[lo:hi]
        tail = flat[lo:n] if lo < n else flat[0:0]
        return ops.cat([tail, ops.zeros(hi - max(lo, n), "float32", like=flat)])

    def start(self, name: str, flat: Array) -> _Pending:
        k, staged = self.paths.choose(flat)  # once per device (a first build compiles): not a phase's time
        t0 = time.perf_counter()
        p, n = self.comm.size, self.ops.size(flat)
        c = chunk_length(n, p, self.codec.align)
        prev = self._previous(self.worker, name, c * p)
        send, own = self._encode_kernel(k, name, flat, n, c, prev, staged) if k is not None else \
            self._encode_ops(name, flat, n, c, prev)
        self._time("encode", t0)
        handle = self.comm.alltoall_async(send, f"hvdp.a2a.{name}") if p > 1 else send
        if self.stats is not None:
            nb = self.codec.payload_nbytes(c)
            self.stats.record(self.codec.name, n, handed=2 * p * nb, sent=two_phase_bytes(nb, p),
                              fp32=ring_allreduce_bytes(4 * n, p))
        return _Pending(name, n, c, handle, own=own, kernels=k, staged=staged, prev_worker=prev)

    def _previous(self, store, name, size):
        """The residual kept under ``name`` if it has ``size`` elements, else None (none yet, or
        another layout's). Never written in place: a step that is rolled back sets it again."""
        return previous(self.ops, store, name, size) if self.error_feedback else None

    def _encode_kernel(self, k, name, flat, n, c, prev, staged=False):
        """Every chunk (+ its residual ``prev``) encoded by one kernel call into the send buffer;
        the new residual is a new buffer (``prev`` stays valid)."""
        ops, p = self.paths.ops_of(staged), self.comm.size
        flat = self.paths.host(flat, staged)
        nb = self.codec.payload_nbytes(c)
        empty = ops.empty  # every byte gets written
        send = empty(p * nb, "uint8", like=flat)
        res = None
        prev = self.paths.host(prev, staged)
        if self.error_feedback:
            res = empty(c * p, "float32", like=flat)
        for i in range(p):
            k.encode(self._chunk(flat, i, c, n, ops), prev=None if prev is None else prev[i * c:(i + 1) * c],
                     residual=None if res is None else res[i * c:(i + 1) * c], out=send[i * nb:(i + 1) * nb])
        if res is not None:
            self.worker.set(name, res)  # a graph framework's store assigns it to its variable
        return self.paths.back(send, staged), None

    def _encode_ops(self, name: str, flat: Array, n: int, c: int, prev):
        # Chunk by chunk: the padded bucket, its corrected value and its decoded value never
        # exist whole; only the new residual and the payloads do (peak memory, issue 18).
        ops, p = self.ops, self.comm.size
        payloads, own = [None] * p, None
        if self.error_feedback:
            def residual_chunks():
                nonlocal own
                # this rank's chunk last: its decoded value (kept for exchange) then overlaps
                # no other chunk's temporaries
                for i in [j for j in range(p) if j != self.comm.rank] + [self.comm.rank]:
                    x = self._chunk(flat, i, c, n)
                    if prev is not None:
                        x = x + prev[i * c:(i + 1) * c]
                    payloads[i] = self.codec.encode(ops, x)
                    part = self.codec.decode(ops, payloads[i], c)
                    if i == self.comm.rank and prev is not None:
                        own = part  # x was this step's own array: exchange may sum into it
                    r = finite_or_zero(self.ops, x - part)
                    del x, part  # not alive while assemble copies r
                    yield i * c, r

            self.worker.set(name, ops.assemble(c * p, "float32", residual_chunks(), like=flat))
        else:
            payloads = [self.codec.encode(ops, self._chunk(flat, i, c, n)) for i in range(p)]
        return ops.cat(payloads), own

    def progress(self, pend: _Pending) -> None:
        if pend.phase == 1 and (self.comm.size == 1 or self.comm.done(pend.handle)):
            self.exchange(pend)

    def exchange(self, pend: _Pending) -> None:
        if pend.phase != 1:  # started already (progress)
            return
        p, c = self.comm.size, pend.chunk
        recv = self._wait(pend.handle) if p > 1 else pend.handle
        t0 = time.perf_counter()
        scale = self.postscale / p if self.op == AVERAGE else self.postscale
        k = pend.kernels
        pend.prev_server = prev = self._previous(self.server, pend.name, c)
        if k is not None:  # decode and sum in one pass, then encode with the server residual
            staged = pend.staged
            kops = self.paths.ops_of(staged)
            acc = k.decode_sum(self.paths.host(recv, staged), p, c, scale)
            pend.own = None
            if self.error_feedback:
                res = kops.empty(c, "float32", like=acc)
                payload = k.encode(acc, prev=self.paths.host(prev, staged), residual=res)
                self.server.set(pend.name, res)
            else:
                payload = k.encode(acc)
            payload = self.paths.back(payload, staged)
        else:
            payload = self._exchange_ops(pend, recv, scale, prev)
        self._time("owner", t0)
        pend.handle = self.comm.allgather_async(payload, f"hvdp.ag.{pend.name}") if p > 1 else payload
        pend.phase = 2

    def _exchange_ops(self, pend, recv, scale, prev):
        ops, p, c = self.ops, self.comm.size, pend.chunk
        nb = self.codec.payload_nbytes(c)
        acc = None
        for j in range(p):  # fixed order: the owner's sum is deterministic
            part = pend.own if (j == self.comm.rank and pend.own is not None) else \
                self.codec.decode(ops, recv[j * nb:(j + 1) * nb], c)
            # acc is this step's own temporary (a decoded chunk): summed into in place
            acc = part if acc is None else ops.add_(acc, part)
        pend.own = None
        if scale != 1.0:
            acc = ops.mul_(acc, scale)
        payload, pend.own_final = self._encode_with_feedback(acc, self.server, pend.name, prev)
        return payload

    def finish(self, pend: _Pending) -> Array:
        """Wait for the allgather and decode: the reduced bucket, the same bits on every rank.

        With error feedback, a result that is not finite (an inf or NaN on some rank, or a sum
        that overflowed) puts this bucket's worker and server residuals back as they were before
        the step, on every rank alike, a rank whose own gradient was finite included: a step a
        loss scaler skips must not hand its (scaled) leftovers to the next one. A residual that
        did not exist before comes back as zeros.
        """
        if pend.phase == 1:
            self.exchange(pend)
        ops, p, c = self.ops, self.comm.size, pend.chunk
        got = self._wait(pend.handle) if p > 1 else pend.handle
        t0 = time.perf_counter()
        nb = self.codec.payload_nbytes(c)
        if pend.kernels is not None:  # straight into the result
            kops = self.paths.ops_of(pend.staged)
            got = self.paths.host(got, pend.staged)
            out = kops.empty(c * p, "float32", like=got)
            for j in range(p):
                pend.kernels.decode(got[j * nb:(j + 1) * nb], c, out=out[j * c:(j + 1) * c])
        else:
            own, pend.own_final = pend.own_final, None
            out = ops.assemble(c * p, "float32", ((j * c, own if (j == self.comm.rank and own is not None)
                                                   else self.codec.decode(ops, got[j * nb:(j + 1) * nb], c))
                                                  for j in range(p)), like=got)
        self._time("final_decode", t0)
        out = self.paths.back(out, pend.staged)
        if self.error_feedback:
            keep_if_finite(self.ops, pend.name, out,
                           ((self.worker, pend.prev_worker), (self.server, pend.prev_server)))
            pend.prev_worker = pend.prev_server = None
        return out[:pend.n]

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"codec": str(self.codec), "size": self.comm.size,
                "worker": self.worker.snapshot(), "server": self.server.snapshot()}

    def load_state_dict(self, state: dict) -> None:
        """Residuals are kept where the bucket layout is unchanged, reset otherwise.

        The worker residual only depends on the bucket's padded length (one of another length
        is ignored when read, see ``_previous``, or replaced by a zero one in a sized store); the
        server residual belongs to this rank's chunk, which moves when the number of workers
        changes. This is the checkpoint rule of both adapters at another number of workers
        (``hvdp.torch.checkpoint``, ``hvdp.keras.checkpoint``; docs/uneven-elastic-checkpoints.md).
        """
        same_codec = state.get("codec") == str(self.codec)
        same_world = same_codec and state.get("size") == self.comm.size
        self.worker.restore(dict(state.get("worker", {})) if same_codec else {})
        self.server.restore(dict(state.get("server", {})) if same_world else {})
