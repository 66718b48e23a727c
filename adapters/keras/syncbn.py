"""``hvd.SyncBatchNormalization``: batch normalization over the global batch (every worker's
samples), on both Keras backends, as ``horovod.tensorflow.SyncBatchNormalization``.

Each rank sums its inputs and their squares over the reduced axes; one differentiable Horovod
allreduce (sums, sums of squares, count) gives the global mean and variance; gradients flow back
through it (Horovod's allreduce gradient is the allreduce of the upstream gradients).
"""
import math

import keras
from keras import ops

from .backend import BACKEND as B


@keras.saving.register_keras_serializable(package="hvdp")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are the global batch's.

    Example::

        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32),
                                  hvd.SyncBatchNormalization(), keras.layers.Activation("relu")])
    """

    def __init__(self, *args, process_set=None, **kwargs):
        if kwargs.get("synchronized"):
            raise ValueError("hvd.SyncBatchNormalization synchronizes through Horovod: leave "
                             "synchronized=False (Keras' own flag needs a tf.distribute strategy)")
        super().__init__(*args, **kwargs)
        self._hvdp_process_set = process_set or B.hvd.global_process_set

    def _moments(self, inputs, mask):
        if mask is not None:
            raise NotImplementedError("hvd.SyncBatchNormalization takes no mask; use "
                                      "keras.layers.BatchNormalization for masked inputs")
        axes = self._reduction_axes
        local_sum = ops.sum(inputs, axis=axes)
        shape = tuple(inputs.shape[i] for i in range(len(inputs.shape)) if i not in axes)
        count = ops.sum(ops.ones_like(inputs), axis=axes)  # the same for every channel
        packed = ops.concatenate([ops.reshape(local_sum, [-1]),
                                  ops.reshape(ops.sum(ops.square(inputs), axis=axes), [-1]),
                                  ops.reshape(count, [-1])[:1]])
        total = B.allreduce_differentiable(packed, f"hvdp.syncbn.{self.name}", self._hvdp_process_set)
        c = math.prod(inputs.shape[i] for i in range(len(inputs.shape)) if i not in axes)
        n = total[2 * c]
        mean = total[:c] / n
        variance = ops.maximum(total[c:2 * c] / n - ops.square(mean), 0.0)
        return ops.reshape(mean, shape), ops.reshape(variance, shape)
