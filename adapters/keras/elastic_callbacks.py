"""Horovod's elastic Keras callbacks, for Keras 3 and any elastic state (``hvd.elastic.KerasState``):
commit every few batches, and keep ``state.batch`` / ``state.epoch`` current so that training
resumed after a reset starts where the last commit left it.

Example::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=callbacks)
"""
import keras


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` after every ``batches_per_commit`` batches and at each epoch's end.

    The count restarts with each ``fit`` (after a reset every rank counts from the same place).
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"batches_per_commit must be at least 1, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """``state.batch``: the index of the last finished batch of this epoch (0 after an epoch's
    end). When ``fit`` knows its steps per epoch, the first epoch after a resume reports as many
    fewer steps as ``state.batch`` says were done (``params["steps"]``, as Horovod sets it: read by
    the callbacks after this one; Keras's loop itself runs ``steps_per_epoch`` steps)."""

    def __init__(self, state):
        super().__init__()
        self.state, self.steps_per_epoch = state, None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """``state.epoch``: the epochs finished over every ``fit`` since the state was made, so the
    ``fit`` after a reset does not repeat a finished one. As in Horovod, Keras's epoch index is
    added to the count at ``fit``'s start: pass ``epochs=total - state.epoch``, not
    ``initial_epoch=state.epoch`` (which would count the earlier epochs twice)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
