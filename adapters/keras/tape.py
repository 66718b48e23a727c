"""``hvd.DistributedGradientTape`` (Keras' TensorFlow backend only: the torch backend's custom
loops call ``loss.backward()`` and ``DistributedOptimizer.apply``)."""
import tensorflow as tf

from .backend import BACKEND as B
from .join import TAPE_REDUCERS
from .optimizer import make_reducer
from .state import attach
from .xla import refuse_xla


class DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients averaged across workers.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression="int8")
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    """

    def __init__(self, gradtape, compression="none", op=B.hvd.Average, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, process_set=B.hvd.global_process_set, policy=None):
        super().__init__(persistent=gradtape._persistent)
        self._tape = gradtape._tape  # take over the recording (as Horovod's tape does)
        self._hvdp_args = (compression, policy, op, gradient_predivide_factor, sparse_as_dense, process_set)
        attach(self, None)  # state_of(tape): the reducer of the last gradient call

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        refuse_xla("DistributedGradientTape.gradient is", "use tf.function(jit_compile=False) for the "
                   "function that calls it")
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(sources)
        # The tape is usually made inside a tf.function step, so a new one appears at every
        # trace; its reducer (and the residual variables) must be the same object each time.
        key = (tuple(map(str, self._hvdp_args)), tuple(id(v) for v in flat))
        if key not in TAPE_REDUCERS:
            # no join control on a tape (hvd.join() refuses its two-phase buckets, hvdp.reduce.join)
            TAPE_REDUCERS[key] = make_reducer(*self._hvdp_args, f"hvdp_tape_residual_{len(TAPE_REDUCERS)}",
                                              uneven_inputs=False)
            TAPE_REDUCERS[key].build(flat)
        red = TAPE_REDUCERS[key]
        attach(self, red)
        return tf.nest.pack_sequence_as(grads, red.reduce(tf.nest.flatten(grads)))

