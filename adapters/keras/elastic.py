"""``hvd.elastic`` for Keras 3: Horovod's ``run`` with a state object that knows Keras 3 models,
hvdp's optimizer (error-feedback residuals included) and the elastic sampler.

Horovod's ``TensorFlowKerasState`` is tf-keras 2 only. Rule after a resize, as in hvdp.torch:
a residual is kept where its layout is unchanged and restarts from zero otherwise; a traced
train step must be traced again (the bucket layout depends on the number of workers), so make
the ``tf.function`` inside the function given to ``run`` (TensorFlow backend).
"""
import keras
from horovod.common.elastic import ObjectState

from hvdp.cluster.elastic import ElasticOrder

from .backend import BACKEND as B
from .elastic_callbacks import CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback  # noqa: F401
from .functions import broadcast_variables
from .state import state_of

_hvd = B.hvd


def run(func):
    """Horovod's elastic ``run`` for the backend: re-sync after a reset, roll back after a failure
    (on TensorFlow every failed Horovod op resets, see ``_backend_tf.TFBackend.elastic_run``)."""
    return B.elastic_run(func)


class ElasticSampler(ElasticOrder):
    """This rank's indices of every step; see :class:`hvdp.cluster.elastic.ElasticOrder` (without
    ``batch_size``: this rank's sample indices, as hvdp.torch's sampler in Horovod's form)."""

    def __init__(self, num_samples, batch_size=None, shuffle=True, seed=0):
        n = num_samples if isinstance(num_samples, int) else len(num_samples)
        super().__init__(n, batch_size, _hvd.rank, _hvd.size, shuffle, seed)


class KerasState(ObjectState):
    """Commit / restore / sync of a Keras 3 model, its (hvdp) optimizer, a sampler and any
    other picklable attributes given as keywords (``epoch=0``, ...). Without ``optimizer``, the
    model's compiled one, as in Horovod; the model must be built (as Horovod requires).

    Example::

        state = hvd.elastic.KerasState(model, opt, sampler=sampler, epoch=0)
    """

    def __init__(self, model, optimizer=None, sampler=None, **kwargs):
        if not model.built:  # its variables appear only later: nothing to save or sync yet
            raise ValueError("hvd.elastic.KerasState needs a built model: start it with keras.Input(shape), "
                             "or call model.build(input_shape) first")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        super().__init__(bcast_object=_hvd.broadcast_object, get_rank=_hvd.rank, **kwargs)
        self._saved_vars = None
        self._ensure_built()
        self.save()

    def _ensure_built(self):
        opt = self.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)

    def _shared_variables(self):
        opt_vars = list(self.optimizer.variables) if self.optimizer is not None else []
        return list(self.model.variables) + opt_vars

    def _reducer(self):
        return state_of(self.optimizer)

    def _snapshot(self):
        red = self._reducer()
        return ([keras.ops.convert_to_numpy(v) for v in self._shared_variables()],
                red.residual_state() if red is not None else None,
                self.sampler.state_dict() if self.sampler is not None else None)

    def save(self):
        self._saved_vars = self._snapshot()
        super().save()

    def restore(self):
        values, residuals, sampler = self._saved_vars
        for v, x in zip(self._shared_variables(), values):
            v.assign(x)
        red = self._reducer()
        if red is not None and residuals is not None:
            red.load_residual_state(residuals)
        if sampler is not None:
            self.sampler.load_state_dict(sampler)
        super().restore()

    def reset(self):
        # after every reset, also one that skips sync (workers only removed): the number of
        # workers changed, and with it the residuals' layout
        red = self._reducer()
        if red is not None:
            red.relayout()

    def sync(self):
        self._ensure_built()
        self.reset()
        red = self._reducer()
        if red is not None and red.plan is not None:  # new workers may differ from the old ones
            red.check_agreement()
        broadcast_variables(self._shared_variables(), root_rank=0)
        if self.sampler is not None:
            self.sampler.load_state_dict(_hvd.broadcast_object(self.sampler.state_dict(), root_rank=0))
        super().sync()
        # what a later restore() goes back to is the synced state, as in Horovod (it saves after
        # its broadcast): else a rank would restore its own pre-sync weights and differ from rank 0
        self._saved_vars = self._snapshot()


class TensorFlowKerasState(KerasState):
    """Horovod's name for the Keras elastic state (``backend``, Horovod's Keras-2 backend module,
    has no meaning on Keras 3 and is ignored)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)
