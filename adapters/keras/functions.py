"""Variable helpers for Keras 3 variables (Horovod's own expect tf.Variable.ref() or torch tensors)."""
from .agreement import check_broadcast
from .backend import BACKEND as B


def broadcast_variables(variables, root_rank, process_set=B.hvd.global_process_set):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras 3 variables; tf.Variables on
    the TensorFlow backend) on every rank, after checking that every rank passes the same names,
    shapes and dtypes.

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    names = [getattr(v, "path", None) or v.name for v in variables]
    check_broadcast(variables, names, root_rank, process_set)
    B.broadcast_variables(variables, names, root_rank, process_set)
