"""Keras's driver of the core's engine (``hvdp.reduce.engine``), shared by the optimizer and the
gradient tape: the layout from the variables, and the step's warm-up and join decisions made
inside the step (graph-safe: ``keras.ops.cond`` on TensorFlow's traced step)."""
import keras

from hvdp.reduce.engine import Engine

from .agreement import VERSIONS, WATCHDOG, allgather_fixed, variable_entries
from .backend import BACKEND as B
from .join import joined_cond
from .localvars import LocalVariables
from .mesh import levels
from .plain import FLOATS, KerasPlain


class GradientReducer:
    """Averages (or sums) a list of gradients over the workers, as ``settings`` say.

    Example::

        red = GradientReducer(ReduceSettings(get("int8"), CompressionPolicy()), None, ps, "hvdp_r")
        red.build(model.trainable_variables)
        grads = red.reduce(grads, optimizer.iterations)
    """

    __slots__ = ("engine", "groups", "local", "variables")

    def __init__(self, settings, hvd_compressor, process_set, prefix, groups=None, local=None):
        """``groups``: Horovod's ``groups=`` of the optimizer as ``(variables, names) -> name tuples``
        (None: no groups); ``local``: the optimizer's ``register_local_var`` variables, a
        :class:`LocalVariables` (None: none, as on a tape)."""
        comm = B.Collectives(process_set)
        self.engine = Engine(settings, B.ops, comm,
                             KerasPlain(comm, settings.op, settings.predivide, settings.sparse_as_dense,
                                        hvd_compressor),
                             allgather_fixed(process_set), versions=VERSIONS,
                             make_store=lambda side: B.Store(f"{prefix}_{side}"),
                             per_bucket_auto=B.eager_steps, eager_scope=B.init_scope, tracing=B.tracing,
                             tensor_word="variable",
                             levels=(lambda: levels(process_set)) if settings.hierarchical else None)
        # settings
        self.groups = groups
        self.local = local if local is not None else LocalVariables(True)
        # internal state
        self.variables = None  # what the engine's layout was made for (None: not built yet)

    @property
    def plan(self):
        return self.engine.plan if self.variables is not None else None

    def build(self, variables, at_build=True):
        if self.variables is not None:
            return
        self.variables = list(variables)
        names = [getattr(v, "path", None) or v.name for v in self.variables]
        self.engine.set_layout(names, [tuple(v.shape) for v in self.variables],
                               [keras.backend.standardize_dtype(v.dtype) in FLOATS for v in self.variables],
                               tensors=variable_entries(self.variables, names), at_creation=at_build,
                               groups=self.groups(self.variables, names) if self.groups else ())

    def matches(self, variables) -> bool:
        """Built for exactly these variables (the same objects, in the same order)?"""
        return len(variables) == len(self.variables) and all(a is b for a, b in zip(variables, self.variables))

    def replan(self, variables):
        """The trainable variables changed (a layer frozen or unfrozen, then ``compile``): the
        engine's new layout (residuals kept only for buckets of the same variables), checked
        again on every rank. Eager, also while a step is traced."""
        with B.init_scope():
            self.variables = None
            self.build(variables)

    def check_agreement(self):
        """Raise the same error on every rank unless all ranks reduce the same variables the
        same way (run when built and after every elastic reset)."""
        self.engine.check(variable_entries(self.variables, self.engine.names))

    def relayout(self):
        """After the number of workers changed: residuals sized for the new layout (kept where
        their size is unchanged, zero otherwise). Eager; retrace train steps after it."""
        self.engine.relayout()

    def residual_state(self):
        return self.engine.residual_state()

    def load_residual_state(self, state):
        self.engine.load_residual_state(state)

    def reduce(self, grads, step=None):
        """``step``: the optimizer's iteration counter, for the warm-up (uncompressed) phase."""
        eng = self.engine
        grads = [B.ops.reshape(B.ops.zeros(n), s) if g is None else g
                 for g, s, n in zip(grads, eng.shapes, eng.numels)]
        eng.begin_step(grads[0] if grads else None)
        warm = eng.settings.policy.warmup_steps

        def run(grads):
            if warm == 0 or step is None:
                return self._compressed(grads)
            return keras.ops.cond(step >= warm, lambda: self._compressed(grads),
                                  lambda: eng.reduce(grads, False))
        out = B.watch(WATCHDOG, "hvdp.keras's gradient reduction", grads, run)
        eng.end_step()
        return out

    def _compressed(self, grads):
        eng = self.engine
        if not (eng.settings.uneven_inputs and eng.uses_two_phase):
            return eng.reduce(grads, True)
        return joined_cond(eng.comm, lambda: eng.reduce(grads, True), lambda: eng.reduce(grads, True, joined=True))


class OptimizerReducer(GradientReducer):
    """A distributed Keras optimizer's one state object: its reducer, plus what the optimizer's
    ``apply`` keeps beside it (``hvdp.keras.state.state_of(optimizer)`` returns it).

    One object serves the optimizer and a ``LossScaleOptimizer`` that Keras wraps around it later
    (``optimizer._late_loss_scale``): ``outer`` then names the optimizer that reduces, and the
    others apply what it hands them.

    Example::

        red = state_of(opt)
        red.backward_passes, red.engine.summary()
    """

    __slots__ = ("backward_passes", "average_aggregated", "accumulators", "count", "outer")

    def __init__(self, settings, hvd_compressor, process_set, prefix, groups=None, local=None,
                 backward_passes=1, average_aggregated=False):
        super().__init__(settings, hvd_compressor, process_set, prefix, groups, local)
        # settings
        self.backward_passes = backward_passes  # Horovod's backward_passes_per_step (k)
        self.average_aggregated = average_aggregated  # k batches' sum divided by k
        # internal state
        self.accumulators = []  # k > 1: one B.Buffer per variable, made at build
        self.count = None  # k > 1: a B.Buffer of the batches accumulated, made at build
        self.outer = None  # the LossScaleOptimizer that reduces in place of the optimizer inside it

    def reduced_elsewhere(self, optimizer) -> bool:
        """Does a ``LossScaleOptimizer`` around ``optimizer`` reduce in its place?"""
        return self.outer is not None and self.outer is not optimizer

    def hand_over(self, outer):
        """``outer`` (a LossScaleOptimizer wrapped around this reducer's optimizer) reduces from
        now on; it starts its own accumulation (its build makes new accumulators)."""
        self.outer = outer
        self.accumulators = []
        self.count = None
