"""Gradient reduction for Keras 3, shared by the optimizer and the gradient tape; written once
over the backend's array ops and collectives (``backend.BACKEND``)."""
import math

import keras

from hvdp.join import JoinableReducer
from hvdp.plan import make_plan
from hvdp.stats import WireStats, ring_allreduce_bytes, two_phase_bytes
from hvdp.twophase import TwoPhaseReducer

from hvdp.codecs.auto import Auto

from .agreement import check_reducer
from .autochoice import choose
from .backend import BACKEND as B
from .join import joined_cond

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _dtype(x) -> str:
    return keras.backend.standardize_dtype(x.dtype)


class GradientReducer:
    """Averages (or sums) a list of gradients over the workers with one codec and policy."""

    def __init__(self, codec, policy, op, predivide, sparse_as_dense, process_set, prefix):
        self.codec, self.policy, self.op = codec, policy, op
        self.predivide, self.sparse_as_dense = predivide, sparse_as_dense
        self.comm = B.Collectives(process_set)
        self.prefix = prefix
        self.settings = {}  # more that every rank must share (the optimizer's accumulation)
        self.uneven_inputs = False  # hvdp.join: switch two-phase buckets to allreduce when a rank joined
        self.hvd_compressor = None  # a Horovod Compressor: compress, sum, decompress (as Horovod)
        self.plan = None
        self.auto_settings = codec if isinstance(codec, Auto) else None  # compression="auto"
        self.auto = None  # its decision and figures, once built

    def build(self, variables):
        if self.plan is not None:
            return
        self.variables = list(variables)
        self.names = [getattr(v, "path", None) or v.name for v in variables]
        self.shapes = [tuple(v.shape) for v in variables]
        self.numels = [int(math.prod(v.shape)) for v in variables]
        floating = [_dtype(v) in _FLOATS for v in variables]
        if self.auto_settings is not None:  # one codec for the model, measured now (eager)
            self.codec = choose(self, self.auto_settings, floating)
        two_phase = not self.codec.summable
        self.plan = make_plan(self.names, self.numels, floating, self.policy, two_phase)
        ef = self.policy.error_feedback
        ef = self.codec.error_feedback_default if ef is None else ef
        self.two_phase = None
        if two_phase:
            ws, ss = B.Store(f"{self.prefix}_w"), B.Store(f"{self.prefix}_s")
            self.two_phase = TwoPhaseReducer(self.codec, B.ops, self.comm, ef, self.op,
                                             self.predivide, worker_store=ws, server_store=ss)
            if ef:
                for b, idx in enumerate(self.plan.buckets):
                    c, padded = self.two_phase.layout(sum(self.numels[i] for i in idx))
                    ws.create(f"b{b}", padded)
                    ss.create(f"b{b}", c)
        check_reducer(self, variables, at_build=True)

    def matches(self, variables) -> bool:
        """Built for exactly these variables (the same objects, in the same order)?"""
        return len(variables) == len(self.variables) and all(a is b for a, b in zip(variables, self.variables))

    def replan(self, variables):
        """The trainable variables changed (a layer frozen or unfrozen, then ``compile``): a new
        plan and new residual variables, zero, since the old ones belong to another layout (the
        rule after a resize: kept only where the layout is unchanged). Every rank does it in the
        same step, and the ranks-agree check runs again. Eager, also while a step is traced."""
        with B.init_scope():
            self.plan = None
            self.build(variables)

    def check_agreement(self):
        """Raise the same error on every rank unless all ranks reduce the same variables the
        same way (run when built and after every elastic reset)."""
        check_reducer(self, self.variables)

    def relayout(self):
        """After the number of workers changed: residual variables to the new layout (kept
        where their size is unchanged, zero otherwise). Eager; retrace train steps after it."""
        if self.two_phase is None or not self.two_phase.error_feedback:
            return
        for b, idx in enumerate(self.plan.buckets):
            c, padded = self.two_phase.layout(sum(self.numels[i] for i in idx))
            self.two_phase.worker.create(f"b{b}", padded)
            self.two_phase.server.create(f"b{b}", c)

    def residual_state(self):
        return None if self.two_phase is None else self.two_phase.state_dict()

    def load_residual_state(self, state):
        if self.two_phase is not None and state is not None:
            self.two_phase.load_state_dict(state)

    # --- reduction --------------------------------------------------------------------------
    def _plain_start(self, g, i, compress):
        """Submit one tensor's allreduce: -> (handle, Horovod compressor context, dtype)."""
        if B.is_sparse(g) and self.sparse_as_dense:
            g = B.dense(g)
        wire = self.codec.wire_dtype if (compress and self.codec.summable) else "float32"
        ctx, dtype = None, None if B.is_sparse(g) else _dtype(g)
        if B.is_sparse(g):  # gathered, never compressed (as Horovod)
            send = g
        elif self.hvd_compressor is not None:  # every step, as hvdp.torch and Horovod do
            send, ctx = self.hvd_compressor.compress(g)
        elif dtype not in _FLOATS or wire == "float32":
            send = g
        else:
            send = B.ops.cast(g, wire)
        handle = self.comm.allreduce_async(send, f"hvdp.ar.{self.names[i]}", self.op,
                                           1.0 / self.predivide, self.predivide)
        return handle, ctx, dtype

    def _plain_finish(self, started):
        handle, ctx, dtype = started
        out = self.comm.wait(handle)
        if dtype is None:
            return out
        if self.hvd_compressor is not None:
            out = self.hvd_compressor.decompress(out, ctx)
        return out if _dtype(out) == dtype else keras.ops.cast(out, dtype)

    def _reduce(self, grads, compress, two_phase=None):
        two_phase = two_phase or self.two_phase
        ops, out = B.ops, list(grads)
        buckets = self.plan.buckets if compress else ()
        in_bucket = {i for idx in buckets for i in idx}
        # every collective submitted before the first wait
        plain = {i: self._plain_start(g, i, compress) for i, g in enumerate(grads) if i not in in_bucket}
        pending = []
        for b, idx in enumerate(buckets):
            flat = ops.cat([ops.cast(B.dense(grads[i]), "float32") for i in idx])
            if self.predivide != 1.0:
                flat = flat / self.predivide
            pending.append(two_phase.start(f"b{b}", flat))
        for p in pending:
            two_phase.exchange(p)
        for i, started in plain.items():
            out[i] = self._plain_finish(started)
        for p, idx in zip(pending, buckets):
            flat, off = two_phase.finish(p), 0
            for i in idx:
                part = ops.reshape(flat[off:off + self.numels[i]], self.shapes[i])
                out[i] = keras.ops.cast(part, _dtype(grads[i]))
                off += self.numels[i]
        return out

    def reduce(self, grads, step=None):
        """``step``: the optimizer's iteration counter, for the warm-up (uncompressed) phase."""
        grads = [B.ops.reshape(B.ops.zeros(n), s) if g is None else g
                 for g, s, n in zip(grads, self.shapes, self.numels)]
        warm = self.policy.warmup_steps
        if warm == 0 or step is None:
            return self._reduce_compressed(grads)
        return keras.ops.cond(step >= warm, lambda: self._reduce_compressed(grads),
                              lambda: self._reduce(grads, False))

    def _reduce_compressed(self, grads):
        if not (self.uneven_inputs and self.two_phase is not None and self.plan.buckets):
            return self._reduce(grads, True)
        joined = JoinableReducer(self.two_phase, lambda: True)
        return joined_cond(self.comm, lambda: self._reduce(grads, True),
                           lambda: self._reduce(grads, True, joined))

    def stats(self):
        """Bytes per step, from the plan (every step hands the same buffers to the collectives)."""
        s, p = WireStats(), self.comm.size
        bucketed = {i for idx in self.plan.buckets for i in idx}
        for i, n in enumerate(self.numels):
            if i in bucketed:
                continue
            # a Horovod compressor's output size is known only when it runs: counted as float32
            b = 2 if self.codec.summable and self.codec.wire_dtype == "float16" else 4
            name = "horovod" if self.hvd_compressor is not None else \
                self.codec.name if self.codec.summable else "none"
            s.record(name, n, b * n,
                     ring_allreduce_bytes(b * n, p), ring_allreduce_bytes(4 * n, p))
        for idx in self.plan.buckets:
            n = sum(self.numels[i] for i in idx)
            c, _ = self.two_phase.layout(n)
            nb = self.codec.payload_nbytes(c)
            s.record(self.codec.name, n, 2 * p * nb, two_phase_bytes(nb, p), ring_allreduce_bytes(4 * n, p))
        s.end_step()
        out = s.summary()["last_step"]
        if self.two_phase is not None and self.two_phase.path is not None:  # once a bucket was reduced
            # which implementation ran ("cpu-c (host copies)" in eager TF, array ops while traced)
            path, why = self.two_phase.path
            out["paths"] = {self.codec.name: path}
            out["paths_why"] = {self.codec.name: why} if why else {}
        return out


TAPE_REDUCERS = {}  # DistributedGradientTape (TF): one reducer per (arguments, sources), kept across traces
