"""Variable helpers for Keras 3 variables (horovod.tensorflow's expect tf.Variable.ref())."""
import horovod.tensorflow as _hvd
import tensorflow as tf

from .agreement import check_broadcast
from .comm import op_name


def broadcast_variables(variables, root_rank, process_set=_hvd.global_process_set):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras 3 or tf.Variables) on every rank,
    after checking that every rank passes the same names, shapes and dtypes."""
    variables = list(variables)
    names = [getattr(v, "path", None) or v.name for v in variables]
    check_broadcast(variables, names, root_rank, process_set)
    for i, (v, name) in enumerate(zip(variables, names)):
        value = tf.convert_to_tensor(v)
        v.assign(_hvd.broadcast(value, root_rank, name=op_name(f"hvdp.bcast.{i}.{name}"),
                                process_set=process_set))
