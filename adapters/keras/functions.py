"""Variable helpers for Keras 3 variables (horovod.tensorflow's expect tf.Variable.ref())."""
import horovod.tensorflow as _hvd
import tensorflow as tf

from .comm import op_name


def broadcast_variables(variables, root_rank, process_set=_hvd.global_process_set):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras 3 or tf.Variables) on every rank."""
    for i, v in enumerate(variables):
        name = getattr(v, "path", None) or v.name
        value = tf.convert_to_tensor(v)
        v.assign(_hvd.broadcast(value, root_rank, name=op_name(f"hvdp.bcast.{i}.{name}"),
                                process_set=process_set))
