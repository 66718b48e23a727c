"""``hvd.DistributedOptimizer`` for Keras 3, on the TensorFlow and the torch backend.

The user's optimizer object becomes an instance of a subclass of its own class (made on the
fly, as Horovod does) whose ``apply`` averages the gradients across workers first. Under the
``mixed_float16`` policy the optimizer is wrapped in Keras' ``LossScaleOptimizer`` *inside*
the distributed layer: the reduction comes first, so every rank sees the same (reduced) scaled
gradients and takes the same finite / non-finite branch (a local check first would let ranks
disagree and hang).
"""
import keras

from hvdp.reduce.settings import ReduceSettings, is_low_rank

from .agreement import REPORTER
from .backend import BACKEND as B
from .compression import resolve
from .join import OPTIMIZERS
from .localvars import LocalVariables, check_arguments, group_names
from .reducer import GradientReducer, OptimizerReducer
from .state import attach, state_of
from .xla import install_auto_jit_veto


class _Distributed:
    """Methods copied into the dynamic subclass (``super(self.__class__, self)`` is the user's class).
    Their state is one :class:`~hvdp.keras.reducer.OptimizerReducer`, ``state_of(self)``."""

    def build(self, variables):
        super(self.__class__, self).build(variables)
        red = state_of(self)
        if red.reduced_elsewhere(self):
            return  # wrapped later by a LossScaleOptimizer, which reduces (see _late_loss_scale)
        red.build(red.local.shared(variables))
        if red.backward_passes > 1 and not red.accumulators:
            red.accumulators = [B.Buffer(v.shape) for v in variables]
            red.count = B.Buffer((), "int64")

    def apply(self, grads, trainable_variables=None):
        red = state_of(self)
        if red.reduced_elsewhere(self):  # its LossScaleOptimizer reduced already
            return super(self.__class__, self).apply(grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads, variables = list(grads), list(trainable_variables)
        B.refuse_xla()
        shared = red.local.shared(variables)
        if not self.built:
            self.build(variables)
        elif red.plan is None:
            red.build(shared)
        elif not red.matches(shared):  # Keras itself takes any subset of what it was built on
            self._hvdp_replan(variables)  # (or a variable was registered as local since)
        parent = super(self.__class__, self)
        k = red.backward_passes
        if k == 1:
            return parent.apply(self._hvdp_reduce(grads, variables), variables)
        for a, g in zip(red.accumulators, grads):
            if g is not None:
                a.add(B.dense(g))
        red.count.add(1)

        def update():
            scale = 1.0 / k if red.average_aggregated else 1.0
            acc = [keras.ops.cast(a.read() * scale, v.dtype) for a, v in zip(red.accumulators, variables)]
            parent.apply(self._hvdp_reduce(acc, variables), variables)
            for a in red.accumulators:
                a.reset()
            return keras.ops.convert_to_tensor(0)

        keras.ops.cond(red.count.read() % k == 0, update,
                       lambda: keras.ops.convert_to_tensor(0))

    def _hvdp_reduce(self, grads, variables):
        red = state_of(self)
        return red.local.reduce(lambda gs: red.reduce(gs, self.iterations), grads, variables,
                                red.engine.comm.size)

    def register_local_var(self, var):
        """Horovod's: ``var`` is worker-local; its gradient is not reduced (each worker applies its
        own, divided by the number of workers unless ``scale_local_gradients=False``)."""
        state_of(self).local.add(var)

    def _hvdp_replan(self, variables):
        red = state_of(self)
        red.replan(red.local.shared(variables))
        if red.backward_passes > 1:  # accumulators follow the new variables; a cycle in progress restarts
            with B.init_scope():
                red.accumulators = [B.Buffer(v.shape) for v in variables]
                red.count.reset()

    def compression_stats(self):
        """Bytes handed to collectives per update step by codec, vs a float32 ring allreduce
        (the same keys as hvdp.torch's); with compression="auto" also ``"auto"``."""
        # steps: the reductions run, which count a traced step's record (see hvdp.reduce.engine)
        return state_of(self).engine.summary(steps=int(keras.ops.convert_to_numpy(self.iterations)))


def user_settings(compression, policy, op, gradient_predivide_factor, sparse_as_dense, backward_passes_per_step=1,
                  uneven_inputs=None, extra=(), hierarchical=False):
    """The user's arguments checked and frozen: ``(ReduceSettings, Horovod compressor or None)``."""
    codec, hvd_compressor = resolve(compression)
    if is_low_rank(codec) and not hasattr(B.ops, "orthonormalize"):
        raise ValueError(f"compression={codec.name!r} needs matrix products, which hvdp.keras's {B.name} array "
                         "ops do not provide: use hvdp.torch, or compression='int8', 'bf16' or 'auto'")
    if op not in (B.hvd.Average, B.hvd.Sum):
        raise ValueError("hvdp.keras supports op=hvd.Average or hvd.Sum")
    settings = ReduceSettings.from_user(codec, hvd_compressor, policy, op_sum=op == B.hvd.Sum,
                                        predivide=gradient_predivide_factor,
                                        backward_passes=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
                                        uneven_inputs=uneven_inputs, hierarchical=hierarchical, extra=tuple(extra))
    return settings, hvd_compressor


def make_reducer(compression, policy, op, gradient_predivide_factor, sparse_as_dense, process_set, prefix,
                 backward_passes_per_step=1, uneven_inputs=None, extra=(), hierarchical=False):
    """The settings checked and frozen, and the reducer that drives the engine with them (a
    gradient tape's: no groups, no local variables)."""
    settings, hvd_compressor = user_settings(compression, policy, op, gradient_predivide_factor, sparse_as_dense,
                                             backward_passes_per_step, uneven_inputs, extra, hierarchical)
    return GradientReducer(settings, hvd_compressor, process_set, prefix)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression="none",
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=B.hvd.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=B.hvd.global_process_set, scale_local_gradients=True,
                         policy=None, uneven_inputs=None, hierarchical=False):
    """Make a Keras 3 optimizer average gradients across workers before each update.

    ``compression``: "none", "fp16", "bf16", "int8", "topk", an ``hvd.Compression`` member, a
    codec, or a Horovod ``Compressor`` (compress, sum, decompress, as in Horovod).
    ``backward_passes_per_step=k`` accumulates k batches locally before one reduction
    and update (``average_aggregated_gradients`` divides the sum by k). ``uneven_inputs``:
    ranks with fewer batches may call ``hvd.join()`` (or use ``hvd.callbacks.JoinCallback`` in
    ``fit``) with any codec; with bf16/int8/int4/topk one tiny allreduce per step says whether
    someone has joined. None (default): on wherever supported, off with ``hierarchical=True``
    (``hvd.join()`` then raises ``hvd.JoinRefused`` saying why); True: insist (an error where
    unsupported); False: off (no per-step control; ``hvd.join()`` with a two-phase codec is refused).
    ``hierarchical=True``: float32 inside each node, the codec between nodes (``hvdp.reduce.hierarchy``;
    needs process sets: ``hvd.init(process_sets="dynamic")`` or ``hvd.hierarchical_process_sets()``).

    Horovod's other arguments (by keyword: hvdp's order differs after ``name``): ``groups`` (or
    the deprecated ``num_groups``), a number or lists of variables, is checked as Horovod checks
    it and joins the ranks-agree check, but changes no value: hvdp submits every tensor of a
    step before the first wait, so Horovod's fusion already packs them (compressed tensors go
    in hvdp's own buckets). ``device_dense`` / ``device_sparse`` are accepted and unused: each
    gradient is reduced on the device it was computed on (where hvdp's codec kernels run).
    ``scale_local_gradients`` applies to variables given to ``opt.register_local_var(v)``.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()), compression="int8")
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"hvdp.keras.DistributedOptimizer wraps a Keras 3 optimizer, got "
                        f"{type(optimizer).__name__}; for tf.keras 2 use horovod.tensorflow.keras")
    if state_of(optimizer) is not None:
        raise ValueError("this optimizer is already distributed")
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    groups = check_arguments(device_dense, device_sparse, num_groups, groups)
    settings, hvd_compressor = user_settings(
        compression, policy, op, gradient_predivide_factor, sparse_as_dense, backward_passes_per_step, uneven_inputs,
        extra=(("average_aggregated_gradients", bool(average_aggregated_gradients)),), hierarchical=hierarchical)
    reducer = OptimizerReducer(
        settings, hvd_compressor, process_set, "hvdp_residual",
        groups=(lambda variables, names: group_names(groups, variables, names)) if groups else None,
        local=LocalVariables(scale_local_gradients),  # shared with a LossScaleOptimizer made later
        backward_passes=backward_passes_per_step, average_aggregated=average_aggregated_gradients)
    REPORTER.install()  # needs the rank, so after hvd.init
    install_auto_jit_veto()  # compile(jit_compile="auto") on a GPU node: no XLA for this model
    return _distribute(optimizer, reducer)


def _distribute(optimizer, reducer):
    """Make ``optimizer`` (the object itself) an instance of a distributed subclass of its class."""
    base = optimizer.__class__
    methods = {k: v for k, v in _Distributed.__dict__.items() if k not in ("__dict__", "__weakref__")}
    # Saved as the user's own class (same module and name): Keras writes the inner optimizer's
    # config, so stock keras.models.load_model rebuilds a plain optimizer with its state, and
    # hvd.load_model makes it distributed again (being distributed is a run-time property).
    cls = type(base.__name__, (base,), dict(methods, __module__=base.__module__,
                                            __qualname__=base.__qualname__))
    serialise_as(cls, base)
    optimizer.__class__ = cls  # keep the object: its variables, config and tracking stay valid
    attach(optimizer, reducer)
    OPTIMIZERS.add(optimizer)
    if optimizer.built:
        optimizer.build(optimizer._trainable_variables)
    return optimizer


def serialise_as(cls, base):
    """Give ``cls`` the saving names of ``base``: the public ``keras.optimizers.<Name>`` or the
    name it was registered under with ``keras.saving.register_keras_serializable`` (Keras looks
    both up by class object, so a subclass made on the fly has neither)."""
    from keras.src import api_export
    from keras.src.saving import object_registration
    public = api_export.get_name_from_symbol(base)
    if public is not None:
        api_export.REGISTERED_OBJS_TO_NAMES.setdefault(cls, public)
    registered = object_registration.get_registered_name(base)
    if registered != base.__name__:
        object_registration.GLOBAL_CUSTOM_NAMES.setdefault(cls, registered)


def _late_loss_scale():
    """``mixed_float16`` set after the optimizer was made: ``Model.compile`` then wraps hvdp's
    optimizer in a new ``LossScaleOptimizer``, whose finite check would run on each rank's own
    gradients before the reduction (an overflow on one rank only: that rank skips the step, the
    others wait in its collectives forever). So when a LossScaleOptimizer wraps a distributed
    optimizer, the LossScaleOptimizer becomes the distributed one, with the same reducer, and
    the inner optimizer stops reducing: the order is then the policy-first one (reduce, then
    the finite check on the reduced gradients, the same on every rank)."""
    cls = keras.optimizers.LossScaleOptimizer
    if getattr(cls.__init__, "_hvdp_late_loss_scale", False):
        return
    plain_init = cls.__init__

    def __init__(self, inner_optimizer, *args, **kwargs):
        plain_init(self, inner_optimizer, *args, **kwargs)
        state = state_of(inner_optimizer)
        if state is not None and state_of(self) is None:
            state.hand_over(self)
            _distribute(self, state)
    __init__._hvdp_late_loss_scale = True
    cls.__init__ = __init__


_late_loss_scale()
