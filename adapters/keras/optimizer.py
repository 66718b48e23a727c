"""``hvd.DistributedOptimizer`` for Keras 3, on the TensorFlow and the torch backend.

The user's optimizer object becomes an instance of a subclass of its own class (made on the
fly, as Horovod does) whose ``apply`` averages the gradients across workers first. Under the
``mixed_float16`` policy the optimizer is wrapped in Keras' ``LossScaleOptimizer`` *inside*
the distributed layer: the reduction comes first, so every rank sees the same (reduced) scaled
gradients and takes the same finite / non-finite branch (a local check first would let ranks
disagree and hang).
"""
import keras

from hvdp.collectives import AVERAGE, SUM
from hvdp.plan import CompressionPolicy
from hvdp.settings import ReduceSettings, compressor_name, is_low_rank

from .agreement import REPORTER
from .backend import BACKEND as B
from .compression import resolve
from .join import OPTIMIZERS
from .reducer import GradientReducer
from .xla import install_auto_jit_veto

_hvd = B.hvd


class _Distributed:
    """Methods copied into the dynamic subclass (``super(self.__class__, self)`` is the user's class)."""

    def build(self, variables):
        super(self.__class__, self).build(variables)
        self._hvdp.build(list(variables))
        k = self._hvdp_k
        if k > 1 and not self._hvdp_acc:
            self._hvdp_acc = [B.Buffer(v.shape) for v in variables]
            self._hvdp_count = B.Buffer((), "int64")

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads, variables = list(grads), list(trainable_variables)
        B.refuse_xla()
        if not self.built:
            self.build(variables)
        elif self._hvdp.plan is None:
            self._hvdp.build(variables)
        elif not self._hvdp.matches(variables):  # Keras itself takes any subset of what it was built on
            self._hvdp_replan(variables)
        parent = super(self.__class__, self)
        if self._hvdp_k == 1:
            return parent.apply(self._hvdp.reduce(grads, self.iterations), variables)
        for a, g in zip(self._hvdp_acc, grads):
            if g is not None:
                a.add(B.dense(g))
        self._hvdp_count.add(1)

        def update():
            scale = 1.0 / self._hvdp_k if self._hvdp_avg_agg else 1.0
            acc = [keras.ops.cast(a.read() * scale, v.dtype) for a, v in zip(self._hvdp_acc, variables)]
            parent.apply(self._hvdp.reduce(acc, self.iterations), variables)
            for a in self._hvdp_acc:
                a.reset()
            return keras.ops.convert_to_tensor(0)

        keras.ops.cond(self._hvdp_count.read() % self._hvdp_k == 0, update,
                       lambda: keras.ops.convert_to_tensor(0))

    def _hvdp_replan(self, variables):
        self._hvdp.replan(variables)
        if self._hvdp_k > 1:  # accumulators follow the new variables; a cycle in progress restarts
            with B.init_scope():
                self._hvdp_acc = [B.Buffer(v.shape) for v in variables]
                self._hvdp_count.reset()

    def compression_stats(self):
        """Bytes handed to collectives per update step by codec, vs a float32 ring allreduce
        (the same keys as hvdp.torch's); with compression="auto" also ``"auto"``."""
        # steps: the reductions run, which count a traced step's record (see hvdp.engine)
        return self._hvdp.engine.summary(steps=int(keras.ops.convert_to_numpy(self.iterations)))


def make_reducer(compression, policy, op, gradient_predivide_factor, sparse_as_dense, process_set, prefix,
                 backward_passes_per_step=1, uneven_inputs=False, extra=(), hierarchical=False):
    """The settings checked and frozen, and the reducer that drives the engine with them."""
    codec, hvd_compressor = resolve(compression)
    if is_low_rank(codec) and not hasattr(B.ops, "orthonormalize"):
        raise ValueError(f"compression={codec.name!r} needs matrix products, which hvdp.keras has on Keras' "
                         f"torch backend only, not on {B.name}: run with KERAS_BACKEND=torch, use hvdp.torch, or "
                         "choose compression='int8', 'bf16' or 'auto'")
    if op not in (_hvd.Average, _hvd.Sum):
        raise ValueError("hvdp.keras supports op=hvd.Average or hvd.Sum")
    settings = ReduceSettings(codec, CompressionPolicy() if policy is None else policy,
                              op=SUM if op == _hvd.Sum else AVERAGE, predivide=gradient_predivide_factor,
                              backward_passes=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
                              uneven_inputs=bool(uneven_inputs), compressor=compressor_name(hvd_compressor),
                              extra=tuple(extra), hierarchical=bool(hierarchical))
    return GradientReducer(settings, hvd_compressor, process_set, prefix)


def DistributedOptimizer(optimizer, name=None, compression="none", backward_passes_per_step=1,
                         average_aggregated_gradients=False, op=_hvd.Average,
                         gradient_predivide_factor=1.0, sparse_as_dense=False,
                         process_set=_hvd.global_process_set, policy=None, uneven_inputs=False,
                         hierarchical=False):
    """Make a Keras 3 optimizer average gradients across workers before each update.

    ``compression``: "none", "fp16", "bf16", "int8", "topk", an ``hvd.Compression`` member, a
    codec, or a Horovod ``Compressor`` (compress, sum, decompress, as in Horovod).
    ``backward_passes_per_step=k`` accumulates k batches locally before one reduction
    and update (``average_aggregated_gradients`` divides the sum by k). ``uneven_inputs=True``:
    ranks with fewer batches may call ``hvd.join()`` (or use ``hvd.callbacks.JoinCallback`` in
    ``fit``) with any codec; one tiny allreduce per step says whether someone has joined.
    ``hierarchical=True``: float32 inside each node, the codec between nodes (``hvdp.hierarchy``;
    needs process sets: ``hvd.init(process_sets="dynamic")`` or ``hvd.hierarchical_process_sets()``).

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()), compression="int8")
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"hvdp.keras.DistributedOptimizer wraps a Keras 3 optimizer, got "
                        f"{type(optimizer).__name__}; for tf.keras 2 use horovod.tensorflow.keras")
    if getattr(optimizer, "_hvdp", None) is not None:
        raise ValueError("this optimizer is already distributed")
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    reducer = make_reducer(compression, policy, op, gradient_predivide_factor, sparse_as_dense,
                           process_set, "hvdp_residual", backward_passes_per_step, uneven_inputs,
                           extra=(("average_aggregated_gradients", bool(average_aggregated_gradients)),),
                           hierarchical=hierarchical)
    REPORTER.install()  # needs the rank, so after hvd.init
    install_auto_jit_veto()  # compile(jit_compile="auto") on a GPU node: no XLA for this model
    base = optimizer.__class__
    methods = {k: v for k, v in _Distributed.__dict__.items() if k not in ("__dict__", "__weakref__")}
    # Saved as the user's own class (same module and name): Keras writes the inner optimizer's
    # config, so stock keras.models.load_model rebuilds a plain optimizer with its state, and
    # hvd.load_model makes it distributed again (being distributed is a run-time property).
    cls = type(base.__name__, (base,), dict(methods, __module__=base.__module__,
                                            __qualname__=base.__qualname__))
    _serialise_as(cls, base)
    optimizer.__class__ = cls  # keep the object: its variables, config and tracking stay valid
    optimizer._hvdp = reducer
    optimizer._hvdp_k = backward_passes_per_step
    optimizer._hvdp_avg_agg = average_aggregated_gradients
    optimizer._hvdp_acc = []
    OPTIMIZERS.add(optimizer)
    if optimizer.built:
        optimizer.build(optimizer._trainable_variables)
    return optimizer


def _serialise_as(cls, base):
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
