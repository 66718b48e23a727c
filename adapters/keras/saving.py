"""``hvd.load_model`` and ``hvd.load_checkpoint``: a saved Keras model back with its optimizer made
distributed, as in Horovod, and each rank's error-feedback residuals with it.

hvdp's optimizer is saved as the user's own optimizer class (see ``optimizer.serialise_as``), so
stock ``keras.models.load_model`` already loads it with its state; this adds the wrapping, and the
error-feedback residuals that ``hvd.callbacks.ModelCheckpoint`` / ``hvd.save_checkpoint`` keep.
The file format (residuals beside the model in the ``.keras`` archive) and the writing side live
in ``checkpoint``; this module only reads (the dependency goes one way: saving -> checkpoint).
"""
import keras

from .checkpoint import read_residuals, restore_outer, restore_residuals
from .optimizer import DistributedOptimizer
from .state import outer_of, state_of


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression="none", legacy_opts=False,
               **kwargs):
    """Load a model saved with ``model.save`` or ``hvd.callbacks.ModelCheckpoint`` and wrap its
    optimizer (variables and step count as saved) in ``hvd.DistributedOptimizer``.

    ``custom_optimizers``: optimizer classes the file names but Keras cannot find (as Horovod);
    ``custom_objects``: passed to ``keras.models.load_model``; ``compression`` and ``kwargs``
    (``backward_passes_per_step``, ``op``, ...): passed to ``DistributedOptimizer``.
    ``legacy_opts`` (Horovod's: tf-keras 2's legacy optimizers) has no meaning on Keras 3 and is
    ignored. A file written
    by ``hvd.callbacks.ModelCheckpoint`` or ``hvd.save_checkpoint`` gives each rank its own
    error-feedback residuals back (same codec; see ``hvdp.keras.checkpoint`` for another number
    of workers); other files start them at zero.

    Example::

        model = hvd.load_model("ckpt.keras", compression="int8")
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """
    objects = dict(custom_objects or {})
    objects.update({c.__name__: c for c in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        opt = DistributedOptimizer(model.optimizer, compression=compression, **kwargs)
        if opt is not model.optimizer:  # wrapped for mixed_float16 on the way
            model.optimizer = opt
        model.train_function = None  # the next fit traces a step with the distributed apply
        restore_residuals(model, filepath)
    return model


def load_checkpoint(path, model=None, **load_model_kwargs):
    """Every rank reads ``path``: the model and optimizer state, and its own residuals.

    With ``model`` (compiled with an ``hvd.DistributedOptimizer``) the state is loaded into it;
    without, ``hvd.load_model(path, **load_model_kwargs)`` makes it (``compression=``, ...).

    Returns:
        ``(model, extra)``: ``extra`` holds the values given to ``hvd.save_checkpoint``.

    Example::

        model, extra = hvd.load_checkpoint("ckpt.keras", compression="int8")
        model.fit(x, y, initial_epoch=extra["epoch"] + 1, ...)
    """
    if model is None:
        model = load_model(path, **load_model_kwargs)
    else:
        opt = getattr(model, "optimizer", None)
        if state_of(opt) is None and outer_of(opt) is None:
            raise ValueError("hvd.load_checkpoint(path, model): compile the model with an "
                             "hvd.DistributedOptimizer (or hvd.OuterOptimizer) first, or pass no model to "
                             "load it from the file")
        if not opt.built:
            opt.build(model.trainable_variables)
        model.load_weights(path)
        restore_residuals(model, path)
        restore_outer(model, path)
    return model, read_residuals(path)[1]
