"""``hvd.OuterOptimizer`` for Keras 3 (both backends): outer steps (``hvdp.outer``). The user's
optimizer takes every inner step alone; every ``sync_every`` steps the pseudo-gradient goes
through the engine and the outer SGD, and every worker continues from the global parameters.

The outer loop runs eagerly around each ``apply``: before it (the first call takes rank 0's
variables as every rank's start and the global parameters) and after it (the syncs due now). In
a step TensorFlow traces, both are ``tf.py_function`` calls at those points of the step; on the
torch backend, plain calls. So ``model.fit`` and custom loops need nothing more.

``warmup_steps=W``: the first W steps are synchronous, each one's gradients averaged over the
ranks before the inner update (float32 as they are, no codec, as ``hvd.DistributedOptimizer``
with ``compression="none"``). Whether a step warms up is decided when it runs: the eager call
after each step sets a switch (``BACKEND.Switch``: a host ``tf.Variable`` read by a
``tf.cond`` in a traced step, a Python bool on the torch backend), so after the warm-up a step
runs no collective and copies nothing to the host for it.

Example::

    opt = hvd.OuterOptimizer(keras.optimizers.AdamW(1e-3), sync_every=8, compression="int8", warmup_steps=96)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""
import keras
import numpy as np

from hvdp.outer import HIERARCHICAL_REFUSAL, OuterLoop, OuterSettings, outer_codec, warmup_steps_of
from hvdp.outer.loop import split
from hvdp.outer.stats import stats
from hvdp.reduce.collectives import AVERAGE
from hvdp.reduce.engine import Engine
from hvdp.reduce.settings import ReduceSettings

from .agreement import REPORTER, VERSIONS, WATCHDOG, allgather_fixed, variable_entries
from .backend import BACKEND as B
from .compression import resolve
from .join import OUTER
from .plain import KerasPlain
from .reducer import GradientReducer
from .optimizer import serialise_as
from .state import attach_outer, outer_of, state_of
from .xla import install_auto_jit_veto


class KerasOuter:
    """One Keras optimizer's outer steps: the settings, one engine per fragment and the loop
    (made at the first step, from the variables the optimizer updates)."""

    def __init__(self, outer: OuterSettings, reduce_settings: ReduceSettings, hvd_compressor, buffers, process_set,
                 warmup=None):
        """``warmup``: ``warmup_compression``'s (ReduceSettings, Horovod compressor), or None (float32)."""
        # settings
        self.settings, self.reduce_settings = outer, reduce_settings
        self.hvd_compressor, self.process_set = hvd_compressor, process_set
        self.buffers = [v for v in (buffers or ()) if keras.backend.standardize_dtype(v.dtype).startswith("float")]
        # internal state
        self.variables, self.fragments, self.engines, self.loop = None, None, [], None
        self.comm = B.Collectives(process_set)
        self.pending = None  # a checkpoint's outer state, taken up when the loop is made
        # on while the next step is a warm-up step (set eagerly, read by the step as it runs)
        self.warming = B.Switch(True, "hvdp_outer_warming") if outer.warmup else None
        # warmup_compression: the warm-up steps' per-step reduction (graph-safe, as hvd.DistributedOptimizer's)
        self.warm_reducer = (GradientReducer(warmup[0], warmup[1], process_set, "hvdp_outer_warmup")
                             if warmup is not None else None)

    def before_step(self, variables) -> None:
        """At the first step, before its update: rank 0's variables on every rank (the common
        start: a broadcast callback may run only after this step) and the loop made from them."""
        if self.loop is not None:
            return
        variables = list(variables)
        names = self._names(variables)
        B.broadcast_variables(variables + self.buffers, names + [f"buffer.{i}" for i in range(len(self.buffers))],
                              0, self.process_set)
        self.build(variables)
        if self.pending is not None:
            self.restore(self.pending)
        self._mark()

    @staticmethod
    def _names(variables):
        return [getattr(v, "path", None) or v.name for v in variables]

    def build(self, variables) -> None:
        """The fragments' engines and the loop, from ``variables`` as they are (no collective)."""
        self.variables = list(variables)
        names = self._names(self.variables)
        self.fragments = split([int(keras.ops.size(v)) for v in self.variables], self.settings.fragments)
        comm = self.comm
        rs = self.reduce_settings
        self.engines = []
        for f, idx in enumerate(self.fragments):
            plain = KerasPlain(comm, rs.op, rs.predivide, rs.sparse_as_dense, self.hvd_compressor)
            eng = Engine(rs, B.ops, comm, plain, allgather_fixed(self.process_set), versions=VERSIONS,
                         per_bucket_auto=False, tensor_word="variable")
            eng.set_layout([names[i] for i in idx], [tuple(self.variables[i].shape) for i in idx], [True] * len(idx),
                           tensors=variable_entries(self.variables, names) if f == 0 else None)
            self.engines.append(eng)
        self._build_warm_reducer(self.variables)  # before a checkpoint's residuals are loaded into it
        self.loop = OuterLoop(self.settings, B.ops, self.engines, self.fragments, self._values(), active=self._active,
                              warmup_engine=self.warm_reducer.engine if self.warm_reducer is not None else None)

    def forget(self) -> None:
        """Back to before the first step (an elastic state committed before it): the next step
        takes rank 0's variables and makes the loop again."""
        self.variables, self.fragments, self.engines, self.loop, self.pending = None, None, [], None, None
        if self.warming is not None:
            self.warming.set(True)

    def abort(self) -> None:
        """Drop a failed sync's reductions (an elastic reset: Horovod's handles are gone)."""
        for eng in self.every_engine():
            eng.abort()

    def relayout(self) -> None:
        """The engines' residual stores at the current number of workers (after a resize)."""
        for eng in self.every_engine():
            eng.relayout()

    def every_engine(self):
        """The fragments' engines and the warm-up's (``warmup_compression``), in the order of
        ``OuterLoop.state()["engines"]``."""
        return self.engines + ([self.warm_reducer.engine] if self.warm_reducer is not None else [])

    def check_agreement(self) -> None:
        """The ranks-agree check of the first fragment's engine (every tensor of the optimizer,
        the outer settings): after an elastic reset, as a new worker may differ."""
        if self.engines:
            self.engines[0].check(variable_entries(self.variables, self._names(self.variables)))

    def _mark(self) -> None:
        """The warm-up switch from the loop: on while the next step is a warm-up step."""
        if self.warming is not None:
            self.warming.set(self.loop.warming_up)

    def average_if_warming(self, grads, variables, token=None, step=None):
        """``grads`` (of ``variables``) averaged over the ranks where the step running is a
        warm-up step, else as they are (decided as the step runs: after ``token``, the first
        step's ``before_step``). ``step``: the optimizer's iterations, for the policy's own
        uncompressed steps (as ``hvd.DistributedOptimizer``'s)."""
        if self.warming is None or not any(g is not None for g in grads):
            return grads
        if self.loop is not None and not self.loop.warming_up and not B.tracing():
            return grads  # a step run eagerly after the warm-up (the torch backend's every step)
        held = [i for i, g in enumerate(grads) if g is not None]
        red = self.warm_reducer
        if red is None:
            def run():
                return self._average([grads[i] for i in held])
        else:  # every variable's gradient reduced (a None one as zeros: the layout), the held ones kept
            self._build_warm_reducer(variables)

            def run():
                out = red.reduce(list(grads), step)
                return [out[i] for i in held]
        out = self.warming.when(run, [grads[i] for i in held], token)
        grads = list(grads)
        for i, g in zip(held, out):
            grads[i] = g
        return grads

    def _build_warm_reducer(self, variables) -> None:
        """The warm-up reducer's layout for ``variables`` (made once; again if they changed), also
        while a step is traced: its residual stores exist before the step runs."""
        red = self.warm_reducer
        if red is None:
            return
        if red.variables is None:
            with B.init_scope():
                red.build(variables, at_build=False)
        elif not red.matches(variables):
            red.replan(variables)

    def _average(self, grads):
        """A synchronous warm-up step: each gradient averaged over the ranks by Horovod's allreduce
        (its dtype, no codec), every one submitted before the first wait."""
        comm = self.engines[0].comm if self.engines else self.comm  # the engine's: in the flight record

        def run(grads):
            handles = [comm.allreduce_async(g, f"hvdp.outer.warmup.{i}", AVERAGE) for i, g in enumerate(grads)]
            return [comm.wait(h) for h in handles]
        return B.watch(WATCHDOG, "hvd.OuterOptimizer's warm-up average", grads, run)

    def restore(self, state: dict) -> None:
        """A checkpoint's outer state (``hvd.load_checkpoint``): now if the loop exists, else at
        the next step (the variables as loaded are the start: every rank gets rank 0's)."""
        if self.loop is None:
            self.pending = state
            return
        self.pending = None
        def arrays(x):  # the file's numpy arrays as the backend's tensors
            if isinstance(x, dict):
                return {k: arrays(v) for k, v in x.items()}
            if isinstance(x, list):
                return [arrays(v) for v in x]
            return keras.ops.convert_to_tensor(x) if isinstance(x, np.ndarray) else x
        self.loop.load_state(dict(state, **{k: arrays(state[k]) for k in ("globals", "momentum", "engines")}))
        self._mark()

    def _active(self) -> int:
        """The ranks taking part in the sync starting now: a 1 per rank summed (a rank that has
        called ``hvd.join()`` adds Horovod's zero)."""
        return int(round(float(B.allreduce_np(np.ones(1, np.float32), "hvdp.outer.active", average=False)[0])))

    def _values(self):
        return [keras.ops.convert_to_tensor(v) for v in self.variables]

    def after_step(self) -> None:
        """After the inner update: the syncs due now; what lands is assigned to the variables."""
        with REPORTER.explaining():
            landed = self.loop.after_step(self._values())
            for i, value in landed:
                self.variables[i].assign(keras.ops.cast(value, self.variables[i].dtype))
            if landed and self.buffers and any(i in self.fragments[0] for i, _ in landed):
                n = self.loop.took_part[0]  # over the ranks that took part in the sync
                for j, b in enumerate(self.buffers):
                    b.assign(B.allreduce_np(keras.ops.convert_to_numpy(b), f"hvdp.outer.buffer.{j}", average=False) / n)
        self._mark()

    def join_refusal(self):
        """Why ``hvd.join()`` cannot be answered now (None: it can): a fragment in flight."""
        if self.loop is not None and self.loop.in_flight:
            return (f"hvd.join() was called while hvd.OuterOptimizer has a fragment in flight (delay="
                    f"{self.settings.delay}): its reduction needs this rank's next step. Fix: call hvd.join() "
                    "at a step where opt.outer.in_flight is False, or use delay=0")
        return None

    def sync_from(self, root: int) -> None:
        """After every rank joined: ``root``'s variables, buffers and outer state (global
        parameters, momentum, step counters) on every rank; residuals stay each rank's own."""
        if self.loop is None or B.hvd.size() <= 1:
            return
        loop = self.loop
        names = [f"outer.{i}" for i in range(len(self.variables))] + [f"buffer.{i}" for i in range(len(self.buffers))]
        B.broadcast_variables(self.variables + self.buffers, names, root, self.process_set)
        mine = {"step": loop.step, "warm": loop.warm, "outer_steps": loop.outer_steps,
                "globals": [np.asarray(keras.ops.convert_to_numpy(g)) for g in loop.globals],
                "momentum": [None if m is None else np.asarray(keras.ops.convert_to_numpy(m)) for m in loop.momentum]}
        got = B.hvd.broadcast_object(mine, root_rank=root, name="hvdp.outer.join.state")
        loop.step, loop.warm, loop.outer_steps = got["step"], got["warm"], list(got["outer_steps"])
        loop.globals = [keras.ops.convert_to_tensor(g) for g in got["globals"]]
        loop.momentum = [None if m is None else keras.ops.convert_to_tensor(m) for m in got["momentum"]]
        self._mark()

    def compression_stats(self) -> dict:
        """Each fragment's statistics per sync and the bytes one worker sends per inner step."""
        return stats(self.settings, self.engines, self.loop)


class _Outer:
    """Methods copied into the dynamic subclass (``super(self.__class__, self)`` is the user's class)."""

    def apply(self, grads, trainable_variables=None):
        outer = outer_of(self)
        variables = list(trainable_variables) if trainable_variables is not None else None
        parent = super(self.__class__, self)
        if variables is None:
            if not self.built:
                raise ValueError("hvd.OuterOptimizer.apply needs trainable_variables on its first call "
                                 "(e.g. opt.apply(grads, model.trainable_variables))")
            variables = list(self._trainable_variables)
        B.refuse_xla("hvd.OuterOptimizer's step is", "compile the model with jit_compile=False")
        started = None if outer.loop is not None else B.eager_call(lambda: outer.before_step(variables), variables)
        grads = outer.average_if_warming(list(grads), variables, started, self.iterations)
        out = B.run_after(started, lambda: parent.apply(grads, variables))
        B.eager_call(outer.after_step, variables)
        return out

    def compression_stats(self) -> dict:
        return outer_of(self).compression_stats()

    @property
    def outer(self):
        """The outer loop (``hvdp.outer.OuterLoop``: ``globals``, ``step``, ``outer_steps``,
        ``in_flight``), as ``opt.outer`` in hvdp.torch; None before the first step."""
        return outer_of(self).loop


def OuterOptimizer(optimizer, sync_every=None, outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression="none",
                   fragments=1, delay=0, mix=0.0, warmup_steps=None, policy=None, buffers=None, hierarchical=False,
                   process_set=None, warmup_compression="none"):
    """Outer steps around a Keras optimizer (DiLoCo; local SGD with ``outer_lr=1, outer_momentum=0``).

    Args:
        optimizer: the inner optimizer (its state stays local to each worker).
        sync_every: H, inner steps between syncs (required); ``"auto"``: chosen after a probe of
            6 inner steps from the measured step and exchange (``hvdp.outer.auto``).
        outer_lr, outer_momentum, nesterov: the outer SGD on the averaged pseudo-gradient.
        compression: the pseudo-gradient's codec: "none", "fp16", "bf16", "int8", "int4", "topk".
        fragments, delay, mix: streaming (``hvdp.outer.OuterSettings``).
        warmup_steps: W synchronous steps first (the gradients averaged before each inner step,
            as ``start_localSGD_iter`` of PyTorch's post-local SGD); the intervals start after them.
            Not given: 0, and rank 0 warns (``hvdp.outer.NoWarmupWarning``): from scratch, give one.
        warmup_compression: the warm-up steps' codec: "none" (float32) or "fp16", "bf16", "int8",
            "int4", "topk" (each step as ``hvd.DistributedOptimizer`` with that compression).
        policy: an ``hvdp.CompressionPolicy``.
        buffers: float variables averaged at the first fragment's syncs (batch-norm statistics:
            ``[v for v in model.non_trainable_variables]``).
        hierarchical: refused (True): outer steps reduce over every rank at once.

    Example::

        model.compile(optimizer=hvd.OuterOptimizer(keras.optimizers.AdamW(1e-3), sync_every=8), loss=...)
    """
    if sync_every is None:
        raise ValueError("hvd.OuterOptimizer needs sync_every=H, the inner steps between syncs (e.g. 8)")
    if hierarchical:
        raise ValueError(HIERARCHICAL_REFUSAL)
    if outer_of(optimizer) is not None or state_of(optimizer) is not None:
        raise ValueError("this optimizer already is an hvd.OuterOptimizer or an hvd.DistributedOptimizer: "
                         "wrap the plain Keras optimizer in one of them")
    codec, hvd_compressor = outer_codec(resolve(compression), "compression", compression)
    wcodec, whvd = outer_codec(resolve(warmup_compression), "warmup_compression", warmup_compression)
    outer = OuterSettings(sync_every, outer_lr, outer_momentum, nesterov, fragments, delay, mix,
                          warmup_steps_of(warmup_steps, B.hvd.rank()), wcodec.name)
    rs = ReduceSettings.from_user(codec, hvd_compressor, policy, extra=(("outer", outer.describe()),))
    warmup = None
    if outer.warmup_compression != "none":
        warmup = (ReduceSettings.from_user(wcodec, whvd, policy, extra=(("outer", outer.describe()),
                                                                       ("phase", "warm-up"))), whvd)
    process_set = process_set if process_set is not None else B.hvd.global_process_set
    REPORTER.install()  # needs the rank, so after hvd.init
    install_auto_jit_veto()  # compile(jit_compile="auto") on a GPU node: no XLA around the outer loop
    base = optimizer.__class__
    methods = {k: v for k, v in _Outer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(base.__name__, (base,), dict(methods, __module__=base.__module__, __qualname__=base.__qualname__))
    serialise_as(cls, base)  # saved as the user's class, as hvd.DistributedOptimizer's
    optimizer.__class__ = cls  # keep the object: its variables, config and tracking stay valid
    attach_outer(optimizer, KerasOuter(outer, rs, hvd_compressor, buffers, process_set, warmup))
    OUTER.add(optimizer)
    return optimizer
