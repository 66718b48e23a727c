"""The callbacks a horovod.tensorflow.keras user knows, for Keras 3."""
import keras
import numpy as np

from hvdp.checkpoint import rank0_writes

from .backend import BACKEND as B
from .checkpoint import CheckpointWriter
from .functions import broadcast_variables
from .join import JoinCallback, has_join_callback  # noqa: F401  (JoinCallback: uneven shards in fit)


def _set_lr(optimizer, lr):
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    inner.learning_rate.assign(lr)


def _get_lr(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return float(keras.ops.convert_to_numpy(inner.learning_rate))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy rank ``root_rank``'s model and optimizer variables to all.

    ``local_variables`` (a variable or a list, as in Horovod; also ``register_local_var(v)``):
    model variables each worker keeps as they are. ``device`` is Horovod's placement argument,
    accepted and unused (each variable is broadcast where it lives). A model that ``fit`` builds
    on its first batch (a ``Sequential`` without ``Input``) has no variables yet when training
    begins: it is broadcast at the end of the first batch instead, Horovod's moment for every
    model (the ranks' first steps, averaged from different starts, are then replaced by the
    root's). hvdp's error-feedback residuals are per worker and are not broadcast.
    """

    def __init__(self, root_rank=0, device="", local_variables=None, process_set=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        # hvdp: e.g. mesh.dp with root_rank=mesh.dp_root (a global rank): only inside that set
        self.process_set = process_set if process_set is not None else B.hvd.global_process_set
        self.broadcast_done = False
        self._local = {}
        if local_variables is not None:
            one = isinstance(local_variables, keras.Variable) or hasattr(local_variables, "ref")
            for v in [local_variables] if one else list(local_variables):
                self.register_local_var(v)

    def register_local_var(self, var):
        """Horovod's: ``var`` (a model variable) is not broadcast."""
        if not (isinstance(var, keras.Variable) or (B.name == "tensorflow" and hasattr(var, "ref"))):
            raise ValueError(f"local variables must be variables (Keras variables, or tf.Variable on "
                             f"TensorFlow), got {type(var).__name__}")
        self._local[id(var)] = var

    def on_train_begin(self, logs=None):
        _check_steps_agree(self.model, self.params)
        self.broadcast_done = False
        if self.model.built and self.model.variables:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:  # built by fit on its first batch
            self._broadcast()

    def _broadcast(self):
        opt = self.model.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        variables = [v for v in self.model.variables if id(v) not in self._local]
        variables += list(opt.variables) if opt is not None else []
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


def _check_steps_agree(model, params):
    """Ranks with different numbers of steps per epoch would pair up different steps and hang
    at the end: the same clear error on every rank instead (unless JoinCallback handles it)."""
    if B.hvd.size() <= 1 or has_join_callback(model):
        return
    steps = (params or {}).get("steps")
    mine = np.array([-1 if steps is None else int(steps)], np.int64)
    every = B.allgather_np(mine, "hvdp.fit.steps").tolist()
    if -1 in every or len(set(every)) == 1:
        return
    raise ValueError(f"model.fit runs a different number of steps per epoch on each rank "
                     f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(every))}): the ranks would "
                     f"hang at the end of the epoch. Fix: pass steps_per_epoch={min(every)} to "
                     f"model.fit on every rank (or shards of equal length), or add "
                     f"hvd.callbacks.JoinCallback() to callbacks (it works with every codec, "
                     f"unless the optimizer was made with uneven_inputs=False or hierarchical=True)")


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replace every logged metric by its average over the workers.

    Put it before callbacks that read the logs (checkpoints, early stopping, CSV logger).
    ``process_set`` (hvdp; e.g. ``mesh.dp``): the average over that set's ranks only.
    ``device`` (Horovod's: where TF places the averaging op) is accepted and changes nothing:
    the metrics are host numbers here.
    """

    def __init__(self, device="", process_set=None):
        super().__init__()
        self.device, self.process_set = device, process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        vals = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        if self.process_set is None or self.process_set.process_set_id == 0:
            avg = B.allreduce_np(vals, f"hvdp.metrics.{epoch}")
        else:
            avg = B.allgather_np(vals[None], f"hvdp.metrics.{epoch}", self.process_set).mean(0)
        for k, v in zip(keys, avg):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a number or a function of the (fractional, unless ``staircase``) epoch.
    ``steps_per_epoch`` is taken from ``fit`` when not given.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0
        self._restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None
        if not self.steps_per_epoch and not self.staircase:
            raise ValueError("pass steps_per_epoch: fit did not report how many steps an epoch has")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase:
            self._adjust(epoch)

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        if not self._in_range(epoch):
            return
        opt = self.model.optimizer
        old, new = _get_lr(opt), self.initial_lr * self.multiplier(epoch)
        _set_lr(opt, new)
        inner = getattr(opt, "inner_optimizer", opt)
        # momentum correction (Goyal et al., 2017): scale momentum by new/old lr for one step
        if self.momentum_correction and hasattr(inner, "momentum") and old > 0 and new != old:
            self._restore_momentum = inner.momentum
            inner.momentum = inner.momentum * new / old

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase:
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            inner = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
            inner.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1), e the fractional epoch
    (Goyal et al., 2017), updated every batch; after the warm-up lr stays ``initial_lr``.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0):
        size = B.hvd.size()
        super().__init__(initial_lr, lambda e: 1.0 / size * (e * (size - 1) / warmup_epochs + 1),
                         start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            _set_lr(self.model.optimizer, self.initial_lr)
        super().on_epoch_end(epoch, logs)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` that writes on rank 0 only (others would race it),
    atomically (temporary file, fsync, rename: a kill mid-write leaves the previous checkpoint
    whole), and keeps hvdp's error-feedback residuals: every rank's are gathered into the
    ``.keras`` file, and ``hvd.load_model`` / ``hvd.load_checkpoint`` give each rank its own back.
    Weights-only checkpoints hold no optimizer state, hence no residuals.

    Every rank must have it in its callbacks (the gathering is a collective). Where rank 0's
    write fails (a full or read-only disk), the previous file stays and every rank's ``fit``
    raises the same ``hvdp.checkpoint.CheckpointWriteError`` (an ``OSError``: path and cause).
    """

    def _save_model(self, epoch, batch, logs):
        writer = CheckpointWriter(self.model, gather=not self.save_weights_only)  # every rank
        model = self.model

        def write():
            model.save = lambda path, *a, **k: writer.save(path, *a, **k)
            model.save_weights = lambda path, *a, **k: writer.save_weights(path, *a, **k)
            try:
                super(ModelCheckpoint, self)._save_model(epoch, batch, logs)
            finally:
                del model.save, model.save_weights  # back to the class's methods
        rank0_writes(write, B.hvd.rank(), B.hvd.broadcast_object, str(self.filepath),
                     what="hvd.callbacks.ModelCheckpoint", name="hvdp.ckpt.callback")


class BestModelCheckpoint(ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: :class:`ModelCheckpoint` with ``save_best_only=True``
    (rank 0 judges "best" by its own logs: put ``MetricAverageCallback`` first so all agree).

    Example::

        hvd.callbacks.BestModelCheckpoint("best.keras", monitor="val_loss")
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)
