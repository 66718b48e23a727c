"""``hvd.elastic`` for Keras 3: Horovod's ``run`` with a state object that knows Keras 3 models,
hvdp's optimizer (error-feedback residuals included) and the elastic sampler.

Horovod's ``TensorFlowKerasState`` is tf-keras 2 only. Rule after a resize, as in hvdp.torch:
a residual is kept where its layout is unchanged and restarts from zero otherwise; a traced
train step must be traced again (the bucket layout depends on the number of workers), so make
the ``tf.function`` inside the function given to ``run`` (TensorFlow backend).

An ``hvd.OuterOptimizer`` goes through a reset as in hvdp.torch (docs/outer-steps.md, "Elastic
training"): a commit saves its outer state (global parameters, outer momentum, step counters,
this rank's residuals; a fragment in flight as not synced); ``sync`` gives every rank rank 0's
outer state and inner optimizer state, and every rank restarts from the global parameters.
"""
import keras
import numpy as np
from horovod.common.elastic import ObjectState

from hvdp.cluster.elastic import ElasticOrder, recorded_attempts

from .backend import BACKEND as B
from .elastic_callbacks import CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback  # noqa: F401
from .functions import broadcast_variables
from .state import outer_of, state_of

_hvd = B.hvd


def run(func):
    """Horovod's elastic ``run`` for the backend: re-sync after a reset, roll back after a failure
    (on TensorFlow every failed Horovod op resets, see ``_backend_tf.TFBackend.elastic_run``)."""
    return B.elastic_run(recorded_attempts(func))


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

    def _outer(self):
        return outer_of(self.optimizer)

    def _snapshot(self):
        red, outer = self._reducer(), self._outer()
        return ([keras.ops.convert_to_numpy(v) for v in self._shared_variables()],
                red.residual_state() if red is not None else None,
                self.sampler.state_dict() if self.sampler is not None else None,
                _host(outer.loop.state(drop_in_flight=True)) if outer is not None and outer.loop is not None
                else None)

    def save(self):
        self._saved_vars = self._snapshot()
        super().save()

    def restore(self):
        values, residuals, sampler, outer_state = self._saved_vars
        for v, x in zip(self._shared_variables(), values):
            v.assign(x)
        red = self._reducer()
        if red is not None and residuals is not None:
            red.load_residual_state(residuals)
        outer = self._outer()
        if outer is not None:
            outer.abort()
            if outer_state is None:  # committed before the first step
                outer.forget()
            else:  # a copy: the loaded tensors may share the saved arrays' memory (torch backend)
                outer.restore(_host(outer_state))
        if sampler is not None:
            self.sampler.load_state_dict(sampler)
        super().restore()

    def reset(self):
        # after every reset, also one that skips sync (workers only removed): the number of
        # workers changed, and with it the residuals' layout
        red = self._reducer()
        if red is not None:
            red.relayout()
        outer = self._outer()
        if outer is not None:
            outer.relayout()

    def sync(self):
        self._ensure_built()
        self.reset()
        red = self._reducer()
        if red is not None and red.plan is not None:  # new workers may differ from the old ones
            red.check_agreement()
        outer = self._outer()
        if outer is not None:
            outer.abort()
            if outer.loop is not None and outer.loop.in_flight:  # a reset right after commit()
                self.restore()
        broadcast_variables(self._shared_variables(), root_rank=0)
        if outer is not None:
            self._sync_outer(outer)
        if self.sampler is not None:
            self.sampler.load_state_dict(_hvd.broadcast_object(self.sampler.state_dict(), root_rank=0))
        super().sync()
        # what a later restore() goes back to is the synced state, as in Horovod (it saves after
        # its broadcast): else a rank would restore its own pre-sync weights and differ from rank 0
        self._saved_vars = self._snapshot()


    def _sync_outer(self, outer):
        """Rank 0's outer state on every rank (this rank's residuals kept where their layout is
        unchanged), and every rank's variables set to the global parameters. A rank without a
        loop yet (a new worker) makes it from the model's trainable variables first."""
        loop = outer.loop
        shared = None
        if loop is not None:  # rank 0's is the one that counts
            shared = {k: v for k, v in _host(loop.state(drop_in_flight=True)).items() if k != "engines"}
            shared["engine_steps"] = [e.step for e in outer.every_engine()]
        shared = _hvd.broadcast_object(shared, root_rank=0, name="hvdp.outer.elastic.state")
        if shared is None:  # rank 0 has not stepped yet: nor has anyone
            outer.forget()
            return
        if loop is None:  # a new rank: residuals from zero
            outer.build(self.model.trainable_variables)
            own = [{"step": 0, "reducer": None} for _ in outer.every_engine()]
        else:
            own = _host([e.state() for e in outer.every_engine()])
        for st, step in zip(own, shared.pop("engine_steps")):  # rank 0's count (a policy warm-up
            st["step"] = step  # must end on every rank at once)
        outer.check_agreement()
        outer.restore(dict(shared, engines=own))
        for v, g in zip(outer.variables, outer.loop.globals):
            v.assign(keras.ops.cast(g, v.dtype))


def _host(x):
    """A copy of ``x`` with every array and tensor as a numpy array (a saved state that later
    steps cannot change)."""
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_host(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return np.array(keras.ops.convert_to_numpy(x), copy=True)


class TensorFlowKerasState(KerasState):
    """Horovod's name for the Keras elastic state (``backend``, Horovod's Keras-2 backend module,
    has no meaning on Keras 3 and is ignored)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)
